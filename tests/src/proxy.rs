//! A TCP proxy that can pass traffic, refuse it, black-hole it, or slow it
//! down, to cut a relay off from its broker (or starve it) without touching
//! the broker itself.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;

/// What the proxy does with connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward bytes both ways.
    Pass,
    /// Close every connection, open or new (a broker that is down).
    Refuse,
    /// Accept connections and forward nothing; open ones stall (a network that
    /// silently drops packets). Leaving this mode closes them.
    BlackHole,
    /// Open connections, and those accepted while in this mode, go silent
    /// for the proxy's life: the peer's kernel still acknowledges every byte
    /// and every keepalive probe, and nothing ever answers or closes. This is
    /// a load balancer (HAProxy in front of a Patroni cluster, say) whose
    /// backend vanished, without a rule that shuts its sessions down. Leaving
    /// this mode lets new connections through; the stranded ones stay
    /// silent.
    Strand,
}

/// A running proxy from `127.0.0.1:port` to an upstream address.
pub struct Proxy {
    /// The port to connect to instead of the upstream's.
    pub port: u16,
    mode: Arc<watch::Sender<Mode>>,
    /// Bytes per second forwarded from client to upstream while passing; 0
    /// for no limit.
    rate: Arc<AtomicU64>,
    /// Milliseconds each chunk from upstream to client is held back.
    delay: Arc<AtomicU64>,
    /// Connections accepted so far.
    accepted: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Starts a proxy on a free local port in front of `upstream` (host:port).
    pub async fn start(upstream: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        Self::start_on(listener, upstream)
    }

    /// Starts a proxy on an already bound listener.
    pub fn start_on(listener: TcpListener, upstream: &str) -> Proxy {
        let port = listener.local_addr().expect("local addr").port();
        let (tx, _) = watch::channel(Mode::Pass);
        let mode = Arc::new(tx);
        let rate = Arc::new(AtomicU64::new(0));
        let delay = Arc::new(AtomicU64::new(0));
        let accepted = Arc::new(AtomicU64::new(0));
        let upstream = upstream.to_owned();
        let (m, r, d) = (Arc::clone(&mode), Arc::clone(&rate), Arc::clone(&delay));
        let a = Arc::clone(&accepted);
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                a.fetch_add(1, Ordering::Relaxed);
                let rx = m.subscribe();
                let upstream = upstream.clone();
                let link = Link {
                    rate: Arc::clone(&r),
                    delay: Arc::clone(&d),
                };
                tokio::spawn(serve(client, upstream, rx, link));
            }
        });
        Proxy {
            port,
            mode,
            rate,
            delay,
            accepted,
            task,
        }
    }

    /// How many connections the proxy has accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Switches mode; open connections react at once.
    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    /// Limits what each connection forwards from its client to the upstream
    /// to `bytes_per_second` (0: no limit), open connections included: a
    /// slow link, or a broker that reads slowly (RabbitMQ's flow control
    /// under disk pressure). Answers come back at full speed.
    pub fn throttle(&self, bytes_per_second: u64) {
        self.rate.store(bytes_per_second, Ordering::Relaxed);
    }

    /// Holds every chunk coming back from the upstream for `delay` before
    /// passing it on (zero: none), open connections included, without
    /// slowing the stream: a broker that takes that long to answer, such as
    /// RabbitMQ confirming only after a slow disk's fsync. Bytes keep their
    /// order; a shorter delay takes effect behind what is already held.
    pub fn delay_answers(&self, delay: Duration) {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.delay.store(ms, Ordering::Relaxed);
    }
}

/// How a proxied connection is slowed, shared with the proxy's handle.
struct Link {
    rate: Arc<AtomicU64>,
    delay: Arc<AtomicU64>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(
    mut client: TcpStream,
    upstream: String,
    mut mode: watch::Receiver<Mode>,
    link: Link,
) {
    let current = *mode.borrow_and_update();
    match current {
        Mode::Refuse => {}
        Mode::Strand => strand(&mut mode).await,
        Mode::BlackHole => {
            // Hold the socket, read nothing, answer nothing, until the mode changes.
            let _ = mode.changed().await;
        }
        Mode::Pass => {
            let Ok(mut server) = TcpStream::connect(&upstream).await else {
                return;
            };
            tokio::select! {
                _ = forward(&mut client, &mut server, &link) => {}
                _ = wait_until_not_pass(&mut mode) => {
                    let now = *mode.borrow();
                    match now {
                        // Stop forwarding but keep both sockets open: the peer
                        // sees silence, not a reset.
                        Mode::BlackHole => {
                            let _ = mode.changed().await;
                        }
                        Mode::Strand => strand(&mut mode).await,
                        Mode::Refuse | Mode::Pass => {}
                    }
                }
            }
        }
    }
    // Dropping the sockets closes them.
}

/// Copies both ways until either side closes, the client's bytes at no more
/// than `link.rate` per second when it is set, the upstream's each held for
/// `link.delay`.
async fn forward(client: &mut TcpStream, server: &mut TcpStream, link: &Link) {
    let (rate, delay) = (&*link.rate, &*link.delay);
    let (mut client_rx, mut client_tx) = client.split();
    let (mut server_rx, mut server_tx) = server.split();
    let up = async {
        // Small reads, so that a limit paces the stream finely.
        let mut buf = vec![0u8; 4096];
        loop {
            let n = match client_rx.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let limit = rate.load(Ordering::Relaxed);
            if limit > 0 {
                tokio::time::sleep(Duration::from_secs_f64(n as f64 / limit as f64)).await;
            }
            if server_tx.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = server_tx.shutdown().await;
    };
    // A delay line: chunks are read as they come and written when due, so
    // a delay adds latency without limiting the rate.
    let (held, mut due) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let read_down = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match server_rx.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let at = Instant::now() + Duration::from_millis(delay.load(Ordering::Relaxed));
            if held.send((at, buf[..n].to_vec())).is_err() {
                break;
            }
        }
    };
    let write_down = async {
        while let Some((at, bytes)) = due.recv().await {
            tokio::time::sleep_until(at).await;
            if client_tx.write_all(&bytes).await.is_err() {
                break;
            }
        }
        let _ = client_tx.shutdown().await;
    };
    let down = async {
        tokio::join!(read_down, write_down);
    };
    tokio::join!(up, down);
}

/// Holds a connection open and silent until the proxy is dropped, whatever
/// the mode becomes.
async fn strand(mode: &mut watch::Receiver<Mode>) {
    while mode.changed().await.is_ok() {}
}

async fn wait_until_not_pass(mode: &mut watch::Receiver<Mode>) {
    while *mode.borrow_and_update() == Mode::Pass {
        if mode.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
