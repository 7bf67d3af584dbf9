//! TLS for the security suite: a throwaway CA and server certificate made at
//! run time, and a TLS-terminating proxy in front of a plain-text service.
//!
//! The proxy speaks TLS from the first byte (AMQPS, Kafka SSL) or, for
//! Postgres, answers the protocol's SSLRequest with 'S' first, as a Postgres
//! server with `ssl = on` does. Behind it, bytes go to the real service in
//! plain text, so the relay's TLS client and its verification are what is
//! tested, against real Postgres, RabbitMQ and Kafka-protocol servers.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{copy_bidirectional, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;

/// A CA, a server certificate it signed for `localhost` and 127.0.0.1, and an
/// unrelated CA, written as PEM files.
pub struct Pki {
    /// The CA that signed the server certificate.
    pub ca_file: PathBuf,
    /// A CA that did not: trusting only it must fail verification.
    pub other_ca_file: PathBuf,
    server: Arc<rustls::ServerConfig>,
}

fn ca(name: &str) -> (CertificateParams, KeyPair, String) {
    let key = KeyPair::generate().expect("ca key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let pem = params.self_signed(&key).expect("self-signed ca").pem();
    (params, key, pem)
}

impl Pki {
    /// Makes the certificates and writes the two CA files under a fresh
    /// directory.
    pub fn new() -> Pki {
        let dir = std::env::temp_dir().join(crate::unique("outbox-pki"));
        std::fs::create_dir_all(&dir).expect("pki dir");
        let (ca_params, ca_key, ca_pem) = ca("outbox test CA");
        let (_, _, other_pem) = ca("some other CA");
        let issuer = Issuer::new(ca_params, ca_key);

        let key = KeyPair::generate().expect("server key");
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
        params
            .subject_alt_names
            .push(SanType::IpAddress("127.0.0.1".parse().expect("ip")));
        params
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        let cert = params.signed_by(&key, &issuer).expect("server cert");

        let ca_file = dir.join("ca.pem");
        let other_ca_file = dir.join("other-ca.pem");
        std::fs::write(&ca_file, ca_pem).expect("write ca");
        std::fs::write(&other_ca_file, other_pem).expect("write other ca");

        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let server = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![CertificateDer::from(cert.der().to_vec())],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            )
            .expect("server config");
        Pki {
            ca_file,
            other_ca_file,
            server: Arc::new(server),
        }
    }
}

impl Default for Pki {
    fn default() -> Self {
        Pki::new()
    }
}

/// How a client starts TLS with the proxied service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handshake {
    /// TLS from the first byte (AMQPS, Kafka SSL).
    Direct,
    /// Postgres: an 8-byte SSLRequest answered with 'S', then TLS.
    Postgres,
}

/// A running TLS-terminating proxy on 127.0.0.1.
pub struct TlsProxy {
    /// Its port.
    pub port: u16,
    handshakes: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl TlsProxy {
    /// Starts a proxy on a free port in front of `upstream` (host:port).
    pub async fn start(pki: &Pki, handshake: Handshake, upstream: &str) -> TlsProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        Self::start_on(pki, handshake, listener, upstream)
    }

    /// Starts a proxy on an already bound listener.
    pub fn start_on(
        pki: &Pki,
        handshake: Handshake,
        listener: TcpListener,
        upstream: &str,
    ) -> TlsProxy {
        let port = listener.local_addr().expect("addr").port();
        let acceptor = TlsAcceptor::from(Arc::clone(&pki.server));
        let handshakes = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&handshakes);
        let upstream = upstream.to_owned();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let acceptor = acceptor.clone();
                let upstream = upstream.clone();
                let counted = Arc::clone(&counted);
                tokio::spawn(async move {
                    let _ = serve(client, acceptor, handshake, &upstream, &counted).await;
                });
            }
        });
        TlsProxy {
            port,
            handshakes,
            task,
        }
    }

    /// TLS handshakes completed so far (clients that trusted the certificate).
    pub fn handshakes(&self) -> usize {
        self.handshakes.load(Ordering::SeqCst)
    }

    /// Stops accepting; open connections end with the runtime.
    pub fn stop(self) {
        self.task.abort();
    }
}

async fn serve(
    mut client: TcpStream,
    acceptor: TlsAcceptor,
    handshake: Handshake,
    upstream: &str,
    handshakes: &AtomicUsize,
) -> std::io::Result<()> {
    if handshake == Handshake::Postgres {
        let mut request = [0u8; 8];
        client.read_exact(&mut request).await?;
        // Length 8, code 80877103: SSLRequest.
        if request != [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f] {
            return Ok(()); // a plain-text client: refuse, as `hostssl` would
        }
        client.write_all(b"S").await?;
    }
    let mut tls = acceptor.accept(client).await?;
    handshakes.fetch_add(1, Ordering::SeqCst);
    let mut server = TcpStream::connect(upstream).await?;
    copy_bidirectional(&mut tls, &mut server).await?;
    Ok(())
}
