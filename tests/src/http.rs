//! A relay's HTTP endpoints as a probe or a scraper sees them.

/// The metrics page, or "" while the endpoint does not answer.
pub async fn scrape(port: u16) -> String {
    get(port, "/metrics")
        .await
        .map(|(_, m)| m)
        .unwrap_or_default()
}

/// A plain HTTP/1.0 GET, as a probe or a scraper would send it: the status
/// and the body.
pub async fn get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.ok()?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((status, body))
}

/// The value of the first sample line starting with `prefix`.
pub fn sample(metrics: &str, prefix: &str) -> Option<f64> {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#') && l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .reduce(|a, b| a + b)
}

/// The messages a relay counted as published, over every destination:
/// `outbox_messages_total` lines labelled `result="published"`. (The relay
/// writes `destination` before `result`, so [`sample`]'s prefix cannot pick
/// them out.)
pub fn published(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("outbox_messages_total{") && l.contains("result=\"published\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
