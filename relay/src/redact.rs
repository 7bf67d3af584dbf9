//! Keeping secrets out of logs, errors and `--help`.

/// Replaces the password in a URL's user-info (`scheme://user:secret@host`) and
/// any `password=...` key-value pair (libpq's keyword form) with `***`.
pub fn redact_url(url: &str) -> String {
    if let Some(scheme_end) = url.find("://") {
        let rest_start = scheme_end + 3;
        let rest = &url[rest_start..];
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        if let Some(at) = rest[..authority_end].rfind('@') {
            let userinfo = &rest[..at];
            if let Some(colon) = userinfo.find(':') {
                return format!(
                    "{}{}:***{}",
                    &url[..rest_start],
                    &userinfo[..colon],
                    &rest[at..]
                );
            }
        }
        return url.to_owned();
    }
    // keyword=value form: host=... password=... (values may be quoted)
    url.split_whitespace()
        .map(|pair| match pair.split_once('=') {
            Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
            _ => pair.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn hides_url_passwords() {
        assert_eq!(
            redact_url("amqp://guest:s3cret@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            redact_url("postgres://u:p%40ss@db/x?sslmode=require"),
            "postgres://u:***@db/x?sslmode=require"
        );
        assert_eq!(redact_url("postgres://u@db/x"), "postgres://u@db/x");
        assert_eq!(redact_url("amqp://h/v?x=a@b"), "amqp://h/v?x=a@b");
    }

    #[test]
    fn hides_keyword_passwords() {
        assert_eq!(
            redact_url("host=db user=u password=hunter2 dbname=x"),
            "host=db user=u password=*** dbname=x"
        );
    }
}
