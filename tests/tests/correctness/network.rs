//! The link between relay and broker black-holed then reset, slowed, or slow
//! to bring the broker's answers back.

use std::time::{Duration, Instant};

use outbox_tests::db::TestDb;
use outbox_tests::eventually;
use outbox_tests::process::{tansu_behind_proxy, RelayProcess};
use outbox_tests::proxy::{Mode, Proxy};
use outbox_tests::sink::Sink;
use outbox_tests::workload::{self, Spec};
use rand::Rng;

use super::{env_for, scale, settle_within, spec, stop, BATCH, PATIENCE, PIPELINE, RELAY_BIN};

/// Runs `scenario` with a proxy in front of the local RabbitMQ.
async fn via_proxy_to_rabbitmq(scenario: impl AsyncFnOnce(TestDb, Sink, &Proxy)) {
    let proxy = Proxy::start("127.0.0.1:5672").await;
    scenario(TestDb::new().await, Sink::amqp().await, &proxy).await;
}

/// Runs `scenario` against a private tansu that advertises a proxy in
/// front of it, so that every connection, the relay's and the consumer's,
/// crosses the proxy.
async fn via_proxy_to_tansu(scenario: impl AsyncFnOnce(TestDb, Sink, &Proxy)) {
    let (tansu, proxy, brokers) = tansu_behind_proxy().await;
    scenario(TestDb::new().await, Sink::kafka(&brokers).await, &proxy).await;
    tansu.stop().await;
}

/// Scenario 6: a proxy between relay and broker black-holes traffic (accepts,
/// never answers) for 10 s, then resets every connection.
async fn black_holed_then_reset(db: TestDb, sink: Sink, proxy: &Proxy) {
    outbox_tests::init_logging();
    let started = Instant::now();
    let via = format!("127.0.0.1:{}", proxy.port);
    let relay = RelayProcess::start(RELAY_BIN, &env_for(&db, &sink, Some(&via)));
    let writers = workload::spawn(&db, spec(&sink, scale(5_000)));
    assert!(
        eventually(PATIENCE, || async { sink.count() > 300 }).await,
        "no flow before the fault"
    );
    proxy.set(Mode::BlackHole);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let during = db.pending().await;
    proxy.set(Mode::Refuse); // resets every open connection
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.set(Mode::Pass);
    let written = writers.await.expect("writers");
    // Only batches in flight when the link went silent can repeat.
    let bound = 2 * BATCH * (PIPELINE + 1);
    settle_within(
        &db,
        &sink,
        &written,
        &format!("{}: black-holed 10s, then reset", sink.broker()),
        started,
        bound,
    )
    .await;
    assert!(during > 0, "the black hole should have built a backlog");
    stop(relay).await;
    sink.cleanup().await;
    db.cleanup().await;
}

#[tokio::test]
async fn s06_amqp_black_holed_then_reset_broker_connection() {
    via_proxy_to_rabbitmq(black_holed_then_reset).await;
}

#[tokio::test]
async fn s06_kafka_black_holed_then_reset_broker_connection() {
    via_proxy_to_tansu(black_holed_then_reset).await;
}

/// Scenario 21: SIGTERM while the link to the broker is black-holed with
/// batches in flight, as when a rolling deploy stops a relay during a
/// network partition. The relay must not wait for a broker that will never
/// answer: it exits 0 once its shutdown grace is over (5 s), leaving what
/// was not confirmed in the outbox. The next relay publishes everything,
/// repeating at most the batches that were in flight. Exiting is given a
/// minute: far more than the grace, so only a relay that hangs fails.
async fn sigterm_while_black_holed(db: TestDb, sink: Sink, proxy: &Proxy) {
    outbox_tests::init_logging();
    let started = Instant::now();
    let via = format!("127.0.0.1:{}", proxy.port);
    let env = env_for(&db, &sink, Some(&via));
    let mut relay = RelayProcess::start(RELAY_BIN, &env);
    let writers = workload::spawn(&db, spec(&sink, scale(3_000)));
    assert!(
        eventually(PATIENCE, || async { sink.count() > 300 }).await,
        "no flow before the fault"
    );
    proxy.set(Mode::BlackHole);
    tokio::time::sleep(Duration::from_secs(1)).await;
    relay.signal("TERM").await;
    let exit = tokio::time::timeout(Duration::from_secs(60), relay.wait()).await;
    // Lifting the black hole closes the connections it held.
    proxy.set(Mode::Pass);
    assert_eq!(
        exit.ok(),
        Some(Some(0)),
        "SIGTERM with the broker black-holed: exit 0 within a minute"
    );
    let written = writers.await.expect("writers");
    let relay = RelayProcess::start(RELAY_BIN, &env);
    let bound = BATCH * (PIPELINE + 1);
    let name = format!("{}: SIGTERM with the broker black-holed", sink.broker());
    settle_within(&db, &sink, &written, &name, started, bound).await;
    stop(relay).await;
    sink.cleanup().await;
    db.cleanup().await;
}

#[tokio::test]
async fn s21_amqp_sigterm_while_the_broker_is_black_holed() {
    via_proxy_to_rabbitmq(sigterm_while_black_holed).await;
}

#[tokio::test]
async fn s21_kafka_sigterm_while_the_broker_is_black_holed() {
    via_proxy_to_tansu(sigterm_while_black_holed).await;
}

/// What the slow link of scenario 7 carries from relay to broker, in bytes
/// per second.
const SLOW_LINK: u64 = 100_000;

/// Scenario 7: the link from relay to broker slows to a crawl (a saturated
/// link, or RabbitMQ reading slowly under flow control) and stays slow. A
/// batch of 100 messages of 4 KB takes about 4 s to cross it, longer than
/// the confirm timeout (3 s), and two batches in flight longer than half the
/// hold limit (5 s). The relay must keep publishing at the link's pace
/// while it is slow, and repeat no more than one cut-short set of batches.
async fn slow_link(db: TestDb, sink: Sink, proxy: &Proxy) {
    let spec = Spec {
        pad: 4_000,
        ..spec(&sink, 600)
    };
    // About 2.5 MB: 25 s at the link's pace.
    let what = format!("link slowed to {SLOW_LINK} bytes/s");
    let bound = BATCH * (PIPELINE + 1);
    drain_while_slow(
        db,
        sink,
        proxy,
        Front::Broker,
        spec,
        &what,
        bound,
        throttled(SLOW_LINK),
    )
    .await;
}

/// Slows the proxy's link to `rate` bytes per second when on, lifts the
/// limit when off.
fn throttled(rate: u64) -> impl Fn(&Proxy, bool) {
    move |p, on| p.throttle(if on { rate } else { 0 })
}

/// What the proxy of [`drain_while_slow`] stands in front of.
#[derive(Clone, Copy)]
enum Front {
    Broker,
    Postgres,
}

/// The relay's environment with `proxy` in `front` of its broker or its
/// Postgres.
fn env_via(db: &TestDb, sink: &Sink, proxy: &Proxy, front: Front) -> Vec<(&'static str, String)> {
    let via = format!("127.0.0.1:{}", proxy.port);
    match front {
        Front::Broker => env_for(db, sink, Some(&via)),
        Front::Postgres => {
            let mut env = env_for(db, sink, None);
            env.push(("OUTBOX_DATABASE_URL", pg_url_via(&via)));
            env
        }
    }
}

/// The test database's URL with `via` (host:port) for its address.
fn pg_url_via(via: &str) -> String {
    let url = outbox_tests::pg_url();
    let (scheme, rest) = url.split_once("://").expect("a postgres:// URL");
    let (user, rest) = rest.rsplit_once('@').map_or(("", rest), |(u, r)| (u, r));
    let path = rest.find('/').map_or("", |i| &rest[i..]);
    let at = if user.is_empty() { "" } else { "@" };
    format!("{scheme}://{user}{at}{via}{path}")
}

/// Starts a relay with `proxy` in `front` of its broker or its Postgres,
/// slows the proxy with `slow(proxy, true)`, writes `spec` (directly, not
/// through the proxy), and requires the outbox to drain while it stays
/// slow; then lifts the slowness and judges the run against `bound`
/// duplicates.
#[allow(clippy::too_many_arguments)]
async fn drain_while_slow(
    db: TestDb,
    sink: Sink,
    proxy: &Proxy,
    front: Front,
    spec: Spec,
    what: &str,
    bound: usize,
    slow: impl Fn(&Proxy, bool),
) {
    outbox_tests::init_logging();
    let started = Instant::now();
    let relay = RelayProcess::start(RELAY_BIN, &env_via(&db, &sink, proxy, front));
    slow(proxy, true);
    let written = workload::spawn(&db, spec).await.expect("writers");
    drained_while_slow(db, sink, proxy, relay, written, what, bound, started, slow).await;
}

/// Requires the outbox to drain while `proxy` stays slow, then lifts the
/// slowness and judges the run against `bound` duplicates.
#[allow(clippy::too_many_arguments)]
async fn drained_while_slow(
    db: TestDb,
    sink: Sink,
    proxy: &Proxy,
    relay: RelayProcess,
    written: workload::Written,
    what: &str,
    bound: usize,
    started: Instant,
    slow: impl Fn(&Proxy, bool),
) {
    let drained = eventually(PATIENCE, || async { db.pending().await == 0 }).await;
    let left = db.pending().await;
    slow(proxy, false);
    assert!(
        drained,
        "{left} of {} rows still waiting after {PATIENCE:?} with the {what}",
        written.committed.len()
    );
    let name = format!("{}: {what}", sink.broker());
    settle_within(&db, &sink, &written, &name, started, bound).await;
    stop(relay).await;
    sink.cleanup().await;
    db.cleanup().await;
}

#[tokio::test]
async fn s07_amqp_slow_link_to_the_broker() {
    via_proxy_to_rabbitmq(slow_link).await;
}

#[tokio::test]
async fn s07_kafka_slow_link_to_the_broker() {
    via_proxy_to_tansu(slow_link).await;
}

/// Scenario 19: scenario 7's slow link in front of one hot key with its
/// rows already waiting, so every batch is full and all of it is for one
/// partition. On Kafka a partition's records travel in one produce request
/// and are confirmed together: a full batch (100 messages of 4 KB, 4 s at
/// the link's pace) times out whole, with nothing confirmed, every time it
/// is sent. The relay must still find a batch size the link carries in
/// time.
async fn slow_link_hot_key(db: TestDb, sink: Sink, proxy: &Proxy) {
    outbox_tests::init_logging();
    let started = Instant::now();
    let spec = Spec {
        pad: 4_000,
        ..Spec::new(sink.destination(), 1, 1, 600)
    };
    let written = workload::run(&db.config, &db.outbox(), &spec).await;
    let relay = RelayProcess::start(RELAY_BIN, &env_via(&db, &sink, proxy, Front::Broker));
    throttled(SLOW_LINK)(proxy, true);
    let what = format!("link slowed to {SLOW_LINK} bytes/s, one hot key");
    let bound = BATCH * (PIPELINE + 1);
    drained_while_slow(
        db,
        sink,
        proxy,
        relay,
        written,
        &what,
        bound,
        started,
        throttled(SLOW_LINK),
    )
    .await;
}

#[tokio::test]
async fn s19_amqp_slow_link_one_hot_key() {
    via_proxy_to_rabbitmq(slow_link_hot_key).await;
}

#[tokio::test]
async fn s19_kafka_slow_link_one_hot_key() {
    via_proxy_to_tansu(slow_link_hot_key).await;
}

/// Scenario 20: scenario 7's slow link in front of a few hot keys, a
/// seeded draw of 2-4 keys written by as many writers while the relay
/// drains, at a seeded pace of 60-150 KB/s. With keys on two or three
/// partitions, a partition whose share of a batch the link cannot carry
/// in time times out while the others answer, which is how a partition
/// without a leader looks; and once the others have drained, its records
/// time out alone. Every key must still drain while the link stays slow.
/// `OUTBOX_TEST_SEED` replays a run.
async fn slow_link_few_hot_keys(db: TestDb, sink: Sink, proxy: &Proxy) {
    use rand::SeedableRng;
    let seed = outbox_tests::seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let keys = rng.random_range(2..=4);
    let rate = rng.random_range(60_000..150_000);
    let spec = Spec {
        pad: 4_000,
        ..Spec::new(sink.destination(), keys, keys, 600)
    };
    let what = format!("link slowed to {rate} bytes/s, {keys} hot keys");
    let bound = BATCH * (PIPELINE + 1);
    drain_while_slow(
        db,
        sink,
        proxy,
        Front::Broker,
        spec,
        &what,
        bound,
        throttled(rate),
    )
    .await;
}

#[tokio::test]
async fn s20_amqp_slow_link_few_hot_keys() {
    via_proxy_to_rabbitmq(slow_link_few_hot_keys).await;
}

#[tokio::test]
async fn s20_kafka_slow_link_few_hot_keys() {
    via_proxy_to_tansu(slow_link_few_hot_keys).await;
}

/// Scenario 22: one message the slow link cannot carry within the confirm
/// timeout (100 KB at 20 KB/s: 5 s against 3 s). Pacing cannot shrink a
/// batch of one, so it is sent again and again and never confirmed. The
/// relay must say so on the row, naming the remedy; and the remedy, a
/// relay restarted with a longer confirm timeout and hold limit, must
/// deliver it while the link stays as slow.
async fn one_message_slower_than_the_confirm_timeout(db: TestDb, sink: Sink, proxy: &Proxy) {
    const RATE: u64 = 20_000;
    outbox_tests::init_logging();
    let started = Instant::now();
    let spec = Spec {
        pad: 100_000,
        rollback_percent: 0,
        ..Spec::new(sink.destination(), 1, 1, 1)
    };
    let written = workload::run(&db.config, &db.outbox(), &spec).await;
    throttled(RATE)(proxy, true);
    let env = env_via(&db, &sink, proxy, Front::Broker);
    let relay = RelayProcess::start(RELAY_BIN, &env);
    let last_error = || async {
        db.column::<Option<String>>(&format!("SELECT last_error FROM {}", db.table()))
            .await
            .into_iter()
            .flatten()
            .next()
    };
    let named = eventually(PATIENCE, || async {
        last_error()
            .await
            .is_some_and(|e| e.contains("raise --confirm-timeout"))
    })
    .await;
    assert!(
        named,
        "the row's last error does not name the remedy: {:?}",
        last_error().await
    );
    stop(relay).await;

    let mut env = env;
    env.push(("OUTBOX_CONFIRM_TIMEOUT", "20s".into()));
    env.push(("OUTBOX_HOLD_LIMIT", "50s".into()));
    let relay = RelayProcess::start(RELAY_BIN, &env);
    let what = format!("link slowed to {RATE} bytes/s, one message of 100 KB");
    // Each send before the restart may have reached the broker whole.
    let bound = 5;
    drained_while_slow(
        db,
        sink,
        proxy,
        relay,
        written,
        &what,
        bound,
        started,
        throttled(RATE),
    )
    .await;
}

#[tokio::test]
async fn s22_amqp_one_message_slower_than_the_confirm_timeout() {
    via_proxy_to_rabbitmq(one_message_slower_than_the_confirm_timeout).await;
}

#[tokio::test]
async fn s22_kafka_one_message_slower_than_the_confirm_timeout() {
    via_proxy_to_tansu(one_message_slower_than_the_confirm_timeout).await;
}

/// How late every answer of the broker of scenario 14 arrives: a sixth of
/// the confirm timeout (3 s).
const SLOW_ANSWERS: Duration = Duration::from_millis(500);

/// Scenario 14: everything the broker sends back (confirms, delivery reports,
/// metadata, handshakes) arrives `SLOW_ANSWERS` late, from the relay's
/// start, while the link carries bytes at full speed: a broker that
/// confirms only after a slow disk's fsync, or a link with a long round
/// trip. Connecting and opening channels take a few such round trips, and
/// each batch waits one for its confirms. The outbox must drain with
/// nothing lost or out of order. Only the first batches, whose time the
/// set-up's round trips eat, may be cut short and repeat.
async fn slow_answers(db: TestDb, sink: Sink, proxy: &Proxy, late: Duration) {
    let spec = spec(&sink, 600);
    let what = format!("broker's answers {late:?} late");
    let bound = BATCH * (PIPELINE + 1);
    drain_while_slow(
        db,
        sink,
        proxy,
        Front::Broker,
        spec,
        &what,
        bound,
        |p, on| p.delay_answers(if on { late } else { Duration::ZERO }),
    )
    .await;
}

#[tokio::test]
async fn s14_amqp_broker_answers_late() {
    via_proxy_to_rabbitmq(async |db, sink, proxy| {
        slow_answers(db, sink, proxy, SLOW_ANSWERS).await
    })
    .await;
}

#[tokio::test]
async fn s14_kafka_broker_answers_late() {
    via_proxy_to_tansu(async |db, sink, proxy| slow_answers(db, sink, proxy, SLOW_ANSWERS).await)
        .await;
}

/// How late every answer of the broker of scenario 15 arrives: half the
/// confirm timeout. Connecting to RabbitMQ and opening a confirm channel
/// take about seven answers, 10.5 s, longer than a batch may take (its
/// answers are due 4.5 s after its claim, with the hold limit of 10 s).
const VERY_SLOW_ANSWERS: Duration = Duration::from_millis(1_500);

/// Scenario 15: scenario 14 with answers so late that no one batch has the
/// time to connect, open its channel and be confirmed. Each batch that
/// runs out of time while the link is being set up must leave what it
/// set up to the next, and nothing it sent (it sent nothing), so that the
/// set-up ends and the outbox drains.
#[tokio::test]
async fn s15_amqp_set_up_longer_than_a_batch() {
    via_proxy_to_rabbitmq(async |db, sink, proxy| {
        slow_answers(db, sink, proxy, VERY_SLOW_ANSWERS).await
    })
    .await;
}

/// On Kafka the set-up is a connection, a producer id and each topic's
/// partitions, five round trips or more: 7.5 s, past the message timeout
/// (3 s) that librdkafka counts from the moment a record is handed to it.
#[tokio::test]
async fn s15_kafka_set_up_longer_than_a_batch() {
    via_proxy_to_tansu(async |db, sink, proxy| {
        slow_answers(db, sink, proxy, VERY_SLOW_ANSWERS).await
    })
    .await;
}

/// How late every answer of the Postgres of scenario 16 arrives.
const SLOW_POSTGRES: Duration = Duration::from_millis(300);

/// Scenario 16: everything Postgres sends the relay arrives `SLOW_POSTGRES`
/// late (a database in another region, or one slow to answer under load),
/// from the relay's start; the writers' own sessions are not slowed. Each
/// batch takes several such round trips (the claim, the durability
/// barrier, the settle), a good share of half the hold limit (5 s). The
/// outbox must drain with nothing lost or out of order, and nothing
/// repeated beyond one cut-short set of batches.
async fn slow_postgres(db: TestDb, sink: Sink) {
    let proxy = Proxy::start(&pg_address()).await;
    let spec = spec(&sink, 600);
    let what = format!("postgres's answers {SLOW_POSTGRES:?} late");
    let bound = BATCH * (PIPELINE + 1);
    drain_while_slow(
        db,
        sink,
        &proxy,
        Front::Postgres,
        spec,
        &what,
        bound,
        |p, on| p.delay_answers(if on { SLOW_POSTGRES } else { Duration::ZERO }),
    )
    .await;
}

/// The test database's host:port.
fn pg_address() -> String {
    let url = outbox_tests::pg_url();
    let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
    let host = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    host.split('/').next().unwrap_or(host).to_owned()
}

#[tokio::test]
async fn s16_amqp_postgres_answers_late() {
    slow_postgres(TestDb::new().await, Sink::amqp().await).await;
}

#[tokio::test]
async fn s16_kafka_postgres_answers_late() {
    slow_postgres(
        TestDb::new().await,
        Sink::kafka(&outbox_tests::kafka_brokers()).await,
    )
    .await;
}

/// One fault of scenario 17's link, held for a while and then lifted.
#[derive(Debug, Clone, Copy)]
enum LinkFault {
    /// Every answer of the broker this late.
    Late(Duration),
    /// The relay's bytes to the broker at this many per second.
    Slow(u64),
    /// Nothing forwarded; lifting it closes the connections.
    BlackHole,
    /// Every connection closed, and new ones refused.
    Refuse,
    /// Open connections silent for good, as behind a load balancer that
    /// lost its backend; new ones pass once it is lifted.
    Strand,
}

impl LinkFault {
    fn pick(rng: &mut impl rand::Rng) -> LinkFault {
        match rng.random_range(0..5) {
            0 => LinkFault::Late(Duration::from_millis(rng.random_range(100..2_000))),
            1 => LinkFault::Slow(rng.random_range(30_000..300_000)),
            2 => LinkFault::BlackHole,
            3 => LinkFault::Refuse,
            _ => LinkFault::Strand,
        }
    }

    fn apply(self, proxy: &Proxy) {
        match self {
            LinkFault::Late(by) => proxy.delay_answers(by),
            LinkFault::Slow(rate) => proxy.throttle(rate),
            LinkFault::BlackHole => proxy.set(Mode::BlackHole),
            LinkFault::Refuse => proxy.set(Mode::Refuse),
            LinkFault::Strand => proxy.set(Mode::Strand),
        }
    }
}

/// Scenario 17: while writers write to a seeded number of keys (1, 3 or
/// 60), the link to the broker goes through a seeded random run of the
/// faults above, each held 1-4 s, with 0-2 s of a clear link between them,
/// for 40 s; then it stays clear. Set-ups cut
/// short, connections dropped with batches in flight, and slow answers
/// meet in orders no single scenario tries. Nothing may be lost or out of
/// order, and each fault may repeat at most the batches then in flight.
/// `OUTBOX_TEST_SEED` replays a run.
async fn link_faults_mixed(db: TestDb, sink: Sink, proxy: &Proxy, front: Front) {
    use rand::SeedableRng;
    outbox_tests::init_logging();
    let seed = outbox_tests::seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let started = Instant::now();
    let relay = RelayProcess::start(RELAY_BIN, &env_via(&db, &sink, proxy, front));
    // The keys' skew is drawn too: one hot key, a few, or many. Each
    // writer owns its keys, so there are no more writers than keys; each
    // is paced so that they write for about as long as the faults last.
    let keys = [1, 3, 60][rng.random_range(0..3)];
    let writers = keys.min(6);
    let paced = Spec {
        writers,
        keys,
        max_commit_delay: Duration::from_millis(350 * writers as u64 / 6),
        ..spec(&sink, scale(4_000))
    };
    let writers = workload::spawn(&db, paced);
    let mut faults = Vec::new();
    let connections_before = proxy.accepted();
    while started.elapsed() < Duration::from_secs(40) {
        let fault = LinkFault::pick(&mut rng);
        fault.apply(proxy);
        faults.push(fault);
        tokio::time::sleep(Duration::from_millis(rng.random_range(1_000..4_000))).await;
        proxy.set(Mode::Pass);
        proxy.throttle(0);
        proxy.delay_answers(Duration::ZERO);
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..2_000))).await;
    }
    let written = writers.await.expect("writers");
    eprintln!("seed {seed}: {keys} keys, faults {faults:?}");
    let bound = faults.len() * BATCH * (PIPELINE + 1);
    let link = match front {
        Front::Broker => "broker",
        Front::Postgres => "postgres",
    };
    let plural = if keys == 1 { "" } else { "s" };
    let name = format!(
        "{}: {} mixed {link} link faults, {keys} key{plural}",
        sink.broker(),
        faults.len()
    );
    settle_within(&db, &sink, &written, &name, started, bound).await;
    // The faults reached the relay: each that closes or strands the
    // connections made it open new ones (and every message still arrived).
    let cutting = faults.iter().any(|f| {
        matches!(
            f,
            LinkFault::BlackHole | LinkFault::Refuse | LinkFault::Strand
        )
    });
    assert!(
        !cutting || proxy.accepted() > connections_before,
        "seed {seed}: no fault made the relay connect again: {faults:?}"
    );
    stop(relay).await;
    sink.cleanup().await;
    db.cleanup().await;
}

#[tokio::test]
async fn s17_amqp_link_faults_mixed() {
    via_proxy_to_rabbitmq(async |db, sink, proxy| {
        link_faults_mixed(db, sink, proxy, Front::Broker).await
    })
    .await;
}

#[tokio::test]
async fn s17_kafka_link_faults_mixed() {
    via_proxy_to_tansu(async |db, sink, proxy| {
        link_faults_mixed(db, sink, proxy, Front::Broker).await
    })
    .await;
}

/// Scenario 18: scenario 17's faults on the relay's link to Postgres
/// instead (its writers connect directly): sessions given up and opened
/// again, claims and settles cut off, the durability barrier and the
/// ownership heartbeat answered late.
#[tokio::test]
async fn s18_amqp_postgres_link_faults_mixed() {
    let proxy = Proxy::start(&pg_address()).await;
    link_faults_mixed(
        TestDb::new().await,
        Sink::amqp().await,
        &proxy,
        Front::Postgres,
    )
    .await;
}

#[tokio::test]
async fn s18_kafka_postgres_link_faults_mixed() {
    let proxy = Proxy::start(&pg_address()).await;
    let sink = Sink::kafka(&outbox_tests::kafka_brokers()).await;
    link_faults_mixed(TestDb::new().await, sink, &proxy, Front::Postgres).await;
}
