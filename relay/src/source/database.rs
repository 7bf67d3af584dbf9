//! How the relay reaches Postgres: the connection settings and TLS.
//!
//! TLS is on when the connection string asks for it with `sslmode=require`,
//! `verify-ca` or `verify-full`, and it is then always verified: the server's
//! certificate must chain to a trusted root and name the host connected to.
//! The roots are the file given as `sslrootcert=<path>` (PEM), or else the
//! system's. The relay never encrypts without verifying, so `require` and
//! `verify-ca` are as strict as `verify-full`; `disable` and `prefer` (the
//! default) connect in plain text.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use std::time::Duration;
use tokio_postgres::config::SslMode;
use tokio_postgres::tls::MakeTlsConnect;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_postgres::{Client, Config, Connection, Socket};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::PgFault;

/// The TLS stream type of relay connections (plain text when TLS is off).
pub type PgStream = <MakeRustlsConnect as MakeTlsConnect<Socket>>::Stream;

/// Postgres connection settings plus the TLS policy derived from them.
#[derive(Clone)]
pub struct Database {
    config: Config,
    tls: MakeRustlsConnect,
    verify: Option<Roots>,
    /// Shared by every clone: when the latest round trip that went
    /// unanswered was sent (see [`Session::answered`]).
    unanswered: Arc<watch::Sender<Option<Instant>>>,
}

/// Where the trusted roots came from, for logs and `Debug`.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Roots {
    File(PathBuf),
    System,
}

/// A connection string the relay cannot use.
#[derive(Debug, thiserror::Error)]
pub enum DatabaseError {
    /// The connection string itself does not parse.
    #[error("not a postgres connection string: {0}")]
    Parse(#[source] tokio_postgres::Error),
    /// `sslmode` has a value libpq does not define.
    #[error("sslmode {0:?} is not one of disable, prefer, require, verify-ca, verify-full")]
    SslMode(String),
    /// The `sslrootcert` file cannot be read or holds no certificate.
    #[error("sslrootcert {path}: {reason}")]
    RootCert {
        /// The file named in the connection string.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}

impl Database {
    /// Parses a libpq-style connection string (URL or `key=value` form),
    /// including `sslmode` and `sslrootcert`.
    pub fn from_url(url: &str) -> Result<Database, DatabaseError> {
        let (config, verify) = parse(url)?;
        let tls = MakeRustlsConnect::new(client_config(verify.as_ref())?);
        Ok(Database {
            config,
            tls,
            verify,
            unanswered: Arc::default(),
        })
    }

    /// Checks that `url` parses, without reading any certificate: for
    /// command-line validation, before the one real [`Database::from_url`].
    pub fn check_url(url: &str) -> Result<(), DatabaseError> {
        parse(url).map(|_| ())
    }

    /// The parsed settings (host, user, database...).
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Whether connections use verified TLS.
    pub fn tls(&self) -> bool {
        self.verify.is_some()
    }

    /// The same database with TCP settings that notice a dead peer within
    /// `bound` instead of the kernel's two hours: keepalive probes on an idle
    /// link, and `tcp_user_timeout` for data the peer never acknowledges
    /// (a half-open connection while a statement is in flight). Settings the
    /// connection string gives itself are kept.
    pub fn with_dead_peer_bound(&self, bound: Duration) -> Database {
        let mut db = self.clone();
        let bound = bound.max(Duration::from_secs(2));
        if db.config.get_tcp_user_timeout().is_none() {
            db.config.tcp_user_timeout(bound);
        }
        db.config
            .keepalives(true)
            .keepalives_idle((bound / 3).max(Duration::from_secs(1)))
            .keepalives_interval((bound / 6).max(Duration::from_secs(1)))
            .keepalives_retries(3);
        db
    }

    /// Opens a connection; the caller drives the returned `Connection`.
    pub async fn connect(
        &self,
    ) -> Result<(Client, Connection<Socket, PgStream>), tokio_postgres::Error> {
        self.config.connect(self.tls.clone()).await
    }

    /// Opens a connection and drives it on a task that ends with the
    /// returned [`Session`].
    pub async fn connect_session(&self) -> Result<Session, tokio_postgres::Error> {
        let opened = Instant::now();
        let (client, driver) = self.connect_driven().await?;
        // Who this session is on the server, for telling later whether the
        // server is still working on a request of its (see
        // `Session::answered`). In the simple protocol, which any pooler
        // passes: behind one that pools by transaction or statement, a
        // prepared statement would fail here, before the relay can say
        // what is wrong with it (`super::check_session`).
        let me = client
            .simple_query(&format!("SELECT pid, {STARTED} {IDENTITY}"))
            .await?;
        let field = |i: usize| {
            me.iter().find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(row) => row.get(i).map(str::to_owned),
                _ => None,
            })
        };
        let (pid, started) = (field(0), field(1));
        Ok(Session {
            client,
            _driver: driver,
            opened,
            pid: pid.and_then(|p| p.parse().ok()).unwrap_or(0),
            backend_start: started.and_then(|s| s.parse().ok()).unwrap_or(0),
            db: self.clone(),
        })
    }

    /// Opens a connection driven by a task that is aborted with the handle.
    async fn connect_driven(
        &self,
    ) -> Result<(Client, tokio_util::task::AbortOnDropHandle<()>), tokio_postgres::Error> {
        let (client, connection) = self.connect().await?;
        let driver = tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "postgres connection ended");
            }
        });
        Ok((client, tokio_util::task::AbortOnDropHandle::new(driver)))
    }

    /// Opens a connection and drives it in the background.
    pub async fn connect_spawned(&self) -> Result<Client, tokio_postgres::Error> {
        let (client, driver) = self.connect_driven().await?;
        drop(driver.detach());
        Ok(client)
    }
}

/// A connection of the relay's: its client, and the task driving it.
///
/// Dropping a session ends that task, and so closes the socket, even while a
/// request on it is still unanswered. A plain `Client` dropped then would
/// leave its driver waiting for that answer for as long as the peer keeps
/// the socket open: a load balancer that lost its backend can keep it so
/// for half an hour (see [`super::answered`]).
pub struct Session {
    client: Client,
    _driver: tokio_util::task::AbortOnDropHandle<()>,
    /// When the connection attempt began.
    opened: Instant,
    /// The server process serving this session, and when it started.
    pid: i32,
    backend_start: i64,
    /// Where the session came from, for asking about it on another
    /// connection; it shares the record of unanswered round trips.
    db: Database,
}

/// When a session's server process started, in microseconds since the
/// epoch: the same number whatever the session's time zone or date style.
const STARTED: &str = "(extract(epoch FROM backend_start) * 1000000)::int8";
/// The row of `pg_stat_activity` of the session that reads it.
const IDENTITY: &str = "FROM pg_stat_activity WHERE pid = pg_backend_pid()";
/// The row of `pg_stat_activity` of process `$1`.
const IDENTITY_OF: &str = "FROM pg_stat_activity WHERE pid = $1";

/// What the server says of a session whose request went unanswered.
enum Seen {
    /// Its process is running a request (a statement waiting on a lock, a
    /// commit waiting for a synchronous standby): the wait is the server's.
    Working,
    /// It is idle, gone, or nowhere to be asked: the request or its answer
    /// went nowhere.
    Stranded,
}

impl Session {
    /// `round_trip`, one or more statements on this session, or
    /// [`PgFault::Unanswered`] once it is known that no answer will come
    /// (see [`super::answered`] for how that happens).
    ///
    /// Each time `bound` passes without the answer, the server is asked,
    /// on a connection of its own, what this session's process is doing.
    /// While it is running a request (waiting on a lock, or a commit
    /// waiting for a synchronous standby that is gone, which Postgres does
    /// not time out), the wait goes on: giving up then would leave that
    /// process waiting behind, holding a connection slot. If the process
    /// is idle or gone, or the server cannot be asked within `bound`, the
    /// session is given up.
    ///
    /// Sessions to one database are stranded together: a load balancer
    /// that lost its backend strands every connection it had open to it.
    /// So once a round trip is given up, every session of the same
    /// [`Database`] opened before that round trip was sent is given up too:
    /// at once if it is waiting, else at its next round trip. Otherwise
    /// each would wait out the bound in turn, and a claim waiting so holds
    /// the other workers' claims back behind it. Sessions opened since
    /// (through the balancer, to the new primary) are not touched.
    pub async fn answered<T>(
        &self,
        bound: Duration,
        round_trip: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, PgFault> {
        let sent = Instant::now();
        let mut round_trip = std::pin::pin!(round_trip);
        let mut lost = self.db.unanswered.subscribe();
        loop {
            tokio::select! {
                biased;
                _ = lost.wait_for(|at| at.is_some_and(|at| at > self.opened)) => {
                    return Err(PgFault::GivenUpWithOthers);
                }
                done = tokio::time::timeout(bound, round_trip.as_mut()) => {
                    if let Ok(done) = done {
                        return Ok(done?);
                    }
                }
            }
            match self.seen(bound).await {
                Seen::Working => {}
                Seen::Stranded => {
                    // An answer that came while the server was asked wins.
                    if let Some(done) = futures::FutureExt::now_or_never(round_trip.as_mut()) {
                        return Ok(done?);
                    }
                    self.db.unanswered.send_if_modified(|at| {
                        let later = at.is_none_or(|at| at < sent);
                        if later {
                            *at = Some(sent);
                        }
                        later
                    });
                    let waited = u64::try_from(sent.elapsed().as_millis()).unwrap_or(u64::MAX);
                    return Err(PgFault::Unanswered(Duration::from_millis(waited)));
                }
            }
        }
    }

    /// What the server says this session's process is doing, asked on a
    /// connection of its own within `bound`.
    async fn seen(&self, bound: Duration) -> Seen {
        let ask = async {
            let (client, _driver) = self.db.connect_driven().await?;
            let working = client
                .query_opt(
                    &format!("SELECT state = 'active' {IDENTITY_OF} AND {STARTED} = $2"),
                    &[&self.pid, &self.backend_start],
                )
                .await?;
            Ok::<_, tokio_postgres::Error>(working.is_some_and(|r| r.get::<_, bool>(0)))
        };
        match tokio::time::timeout(bound, ask).await {
            Ok(Ok(true)) => Seen::Working,
            _ => Seen::Stranded,
        }
    }
}

impl std::ops::Deref for Session {
    type Target = Client;

    fn deref(&self) -> &Client {
        &self.client
    }
}

/// Plain text, as tokio-postgres' `NoTls` would: for configs built in code.
/// A config that requires TLS gets it, verified against the system's roots.
impl From<Config> for Database {
    fn from(mut config: Config) -> Database {
        let verify = (config.get_ssl_mode() == SslMode::Require).then_some(Roots::System);
        if verify.is_none() {
            config.ssl_mode(SslMode::Disable);
        }
        // Only a root file can make client_config fail, and there is none here;
        // unloadable system roots leave an empty store, so handshakes fail
        // verification rather than pass unverified.
        let tls = MakeRustlsConnect::new(
            client_config(verify.as_ref()).expect("system roots and ring's protocol versions"),
        );
        Database {
            config,
            tls,
            verify,
            unanswered: Arc::default(),
        }
    }
}

impl fmt::Debug for Database {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Config's Debug already hides the password.
        f.debug_struct("Database")
            .field("config", &self.config)
            .field("tls", &self.verify)
            .finish()
    }
}

/// The settings and TLS policy of a connection string, checked but with no
/// certificate read yet.
fn parse(url: &str) -> Result<(Config, Option<Roots>), DatabaseError> {
    let (rest, mode, rootcert) = take_tls_params(url);
    let mut config = Config::from_str(&rest).map_err(DatabaseError::Parse)?;
    let verify = match mode.as_deref() {
        None | Some("disable") | Some("prefer") => None,
        Some("require") | Some("verify-ca") | Some("verify-full") => Some(match rootcert {
            Some(path) => Roots::File(PathBuf::from(path)),
            None => Roots::System,
        }),
        Some(other) => return Err(DatabaseError::SslMode(other.to_owned())),
    };
    config.ssl_mode(if verify.is_some() {
        SslMode::Require
    } else {
        SslMode::Disable
    });
    Ok((config, verify))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn client_config(verify: Option<&Roots>) -> Result<rustls::ClientConfig, DatabaseError> {
    let mut roots = rustls::RootCertStore::empty();
    match verify {
        None => {}
        Some(Roots::System) => {
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        }
        Some(Roots::File(path)) => {
            for cert in read_pem(path)? {
                roots.add(cert).map_err(|e| DatabaseError::RootCert {
                    path: path.clone(),
                    reason: e.to_string(),
                })?;
            }
        }
    }
    Ok(rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| DatabaseError::RootCert {
            path: PathBuf::new(),
            reason: e.to_string(),
        })?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

fn read_pem(path: &Path) -> Result<Vec<CertificateDer<'static>>, DatabaseError> {
    let err = |reason: String| DatabaseError::RootCert {
        path: path.to_owned(),
        reason,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| err(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(e.to_string()))?;
    if certs.is_empty() {
        return Err(err("no PEM certificate in the file".into()));
    }
    Ok(certs)
}

/// Removes `sslmode` and `sslrootcert` from a connection string (tokio-postgres
/// knows neither `verify-*` nor `sslrootcert`) and returns them.
fn take_tls_params(url: &str) -> (String, Option<String>, Option<String>) {
    let mut mode = None;
    let mut rootcert = None;
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let Some((base, query)) = url.split_once('?') else {
            return (url.to_owned(), None, None);
        };
        let mut kept = Vec::new();
        for pair in query.split('&') {
            match pair.split_once('=') {
                Some(("sslmode", v)) => mode = Some(percent_decode(v)),
                Some(("sslrootcert", v)) => rootcert = Some(percent_decode(v)),
                _ => kept.push(pair),
            }
        }
        let rest = if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        (rest, mode, rootcert)
    } else {
        // key=value form; values with spaces must be quoted, which this keeps.
        let mut kept = Vec::new();
        for word in url.split_whitespace() {
            match word.split_once('=') {
                Some(("sslmode", v)) => mode = Some(v.trim_matches('\'').to_owned()),
                Some(("sslrootcert", v)) => rootcert = Some(v.trim_matches('\'').to_owned()),
                _ => kept.push(word),
            }
        }
        (kept.join(" "), mode, rootcert)
    }
}

fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_parameters_are_taken_out_of_urls_and_key_value_strings() {
        let (rest, mode, root) = take_tls_params(
            "postgres://u:p@db.internal:5432/app?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x",
        );
        assert_eq!(
            rest,
            "postgres://u:p@db.internal:5432/app?application_name=x"
        );
        assert_eq!(mode.as_deref(), Some("verify-full"));
        assert_eq!(root.as_deref(), Some("/etc/ca.pem"));
        let (rest, mode, root) =
            take_tls_params("host=db user=u sslmode=require sslrootcert=/ca.pem dbname=app");
        assert_eq!(rest, "host=db user=u dbname=app");
        assert_eq!(mode.as_deref(), Some("require"));
        assert_eq!(root.as_deref(), Some("/ca.pem"));
        assert_eq!(
            take_tls_params("postgres://localhost/app"),
            ("postgres://localhost/app".to_owned(), None, None)
        );
    }

    #[test]
    fn checking_a_url_reads_no_certificate_and_odd_escapes_do_not_panic() {
        let url = "postgres://localhost/app?sslmode=verify-full&sslrootcert=/no/such/ca.pem";
        Database::check_url(url).expect("syntax is fine");
        assert!(matches!(
            Database::from_url(url),
            Err(DatabaseError::RootCert { .. })
        ));
        // A '%' followed by a multi-byte character is kept as it is.
        let (_, _, root) = take_tls_params("postgres://h/app?sslrootcert=%a\u{e9}x");
        assert_eq!(root.as_deref(), Some("%a\u{e9}x"));
    }

    #[test]
    fn tls_is_on_only_when_asked_and_then_verified() {
        assert!(!Database::from_url("postgres://localhost/app")
            .expect("url")
            .tls());
        assert!(
            !Database::from_url("postgres://localhost/app?sslmode=prefer")
                .expect("url")
                .tls()
        );
        assert!(
            Database::from_url("postgres://localhost/app?sslmode=verify-full")
                .expect("url")
                .tls()
        );
        assert!(matches!(
            Database::from_url("postgres://localhost/app?sslmode=allow-anything"),
            Err(DatabaseError::SslMode(_))
        ));
        let missing = Database::from_url(
            "postgres://localhost/app?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
        );
        assert!(
            matches!(&missing, Err(DatabaseError::RootCert { path, .. }) if path == Path::new("/nonexistent/ca.pem")),
            "{missing:?}"
        );
    }
}
