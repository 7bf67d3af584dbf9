//! Poison messages: dead-lettered while the others flow, parking its key (or
//! skipping it), and a retry from the dead letters that delivers in order.

use std::time::Duration;

use outbox_client::{Message, MessageId};
use outbox_tests::amqp::{self, Fixture};
use outbox_tests::db::TestDb;
use outbox_tests::{eventually, InProcessRelay};

use super::{cli, msg, settings, PATIENCE};

/// A relay, a test queue on RabbitMQ, and `side`: an exchange bound to no
/// queue, so whatever is published there comes back unroutable.
struct Setup {
    db: TestDb,
    rabbit: Fixture,
    side: String,
    relay: InProcessRelay,
}

impl Setup {
    async fn new(park: bool) -> Setup {
        outbox_tests::init_logging();
        let db = TestDb::new().await;
        let rabbit = Fixture::new().await;
        let side = outbox_tests::unique("side");
        amqp::declare_unbound_exchange(&side).await;
        let relay = InProcessRelay::amqp(&db, settings(park));
        Setup {
            db,
            rabbit,
            side,
            relay,
        }
    }

    async fn finish(self) {
        self.relay.stop().await;
        amqp::delete_exchange(&self.side).await;
        self.rabbit.cleanup().await;
        self.db.cleanup().await;
    }
}

/// Enqueues `failing` (a message that fails for good) in one batch with 40
/// messages of four other keys, then 150 more of those over 3 s, so that
/// claims take them together with it. Waits up to 30 s for the outbox to
/// empty with `dead` dead letters and the others received, then checks that
/// each of them arrived once: a settle that fails at every claim sends its
/// batch again each time, and leaves its rows in the outbox.
async fn failing_amid_others(setup: &Setup, failing: Message, dead: i64) {
    let (db, rabbit) = (&setup.db, &setup.rabbit);
    let outbox = db.outbox();
    let mut batch = vec![failing];
    batch.extend((0..40).map(|i| msg(&rabbit.exchange, &format!("k{}", i % 4), i)));
    let mut ids = outbox
        .enqueue_batch(&db.client, &batch)
        .await
        .expect("enqueue");
    for round in 0..15 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let more: Vec<Message> = (0..10)
            .map(|i| {
                msg(
                    &rabbit.exchange,
                    &format!("k{}", i % 4),
                    100 + round * 10 + i,
                )
            })
            .collect();
        ids.extend(
            outbox
                .enqueue_batch(&db.client, &more)
                .await
                .expect("enqueue"),
        );
    }
    let others: Vec<String> = ids[1..].iter().map(|i| i.to_string()).collect();
    let settled = eventually(Duration::from_secs(30), || async {
        db.pending().await == 0
            && db.count("dead_letters").await == dead
            && rabbit.count() >= others.len()
    })
    .await;
    let delivered = rabbit.message_ids();
    let copies = |id: &String| delivered.iter().filter(|d| *d == id).count();
    let left: Vec<String> = db
        .column(&format!(
            "SELECT format('%s %s %s %s %s', seq, ordering_key, attempts, next_attempt_at, last_error) \
             FROM {} ORDER BY seq LIMIT 10",
            db.table()
        ))
        .await;
    assert!(
        settled,
        "{} rows still in the outbox, {} dead letters; the other messages went out up to {} \
         times; first rows left: {left:?}",
        db.pending().await,
        db.count("dead_letters").await,
        others.iter().map(copies).max().unwrap_or(0)
    );
    assert!(
        others.iter().all(|id| copies(id) == 1),
        "copies of the other messages: {:?}",
        others.iter().map(copies).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn poison_message_dead_letters_while_10000_others_flow() {
    let setup = Setup::new(true).await;
    let (db, rabbit) = (&setup.db, &setup.rabbit);
    let outbox = db.outbox();
    let poison = outbox
        .enqueue(&db.client, &msg(&setup.side, "p", 0))
        .await
        .expect("enqueue");
    for chunk in 0..10 {
        let batch: Vec<Message> = (0..1000)
            .map(|i| msg(&rabbit.exchange, &format!("k{}", i % 100), chunk * 1000 + i))
            .collect();
        outbox
            .enqueue_batch(&db.client, &batch)
            .await
            .expect("enqueue");
    }
    assert!(
        eventually(PATIENCE, || async { rabbit.count() >= 10_000 }).await,
        "others blocked"
    );
    assert!(
        eventually(PATIENCE, || async { db.count("dead_letters").await == 1 }).await,
        "poison not dead-lettered"
    );
    let (code, out, _) = cli(db, &["locate", &poison.to_string(), "--json"]).await;
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["state"], "dead_lettered");
    assert_eq!(v["attempts"], 3);
    assert!(
        v["last_error"]
            .as_str()
            .unwrap_or("")
            .contains("unroutable"),
        "{v}"
    );
    assert_eq!(db.pending().await, 0);
    setup.finish().await;
}

/// A poison message parks only its own key; fixing the binding and retrying it
/// from the dead letters delivers the key's messages in order.
#[tokio::test]
async fn parking_holds_back_one_key_and_retry_delivers_in_order() {
    let setup = Setup::new(true).await;
    let (db, rabbit, side) = (&setup.db, &setup.rabbit, setup.side.as_str());
    let outbox = db.outbox();

    // Key "k": its first message goes to an exchange nobody listens on yet.
    let first = outbox
        .enqueue(&db.client, &msg(side, "k", 0))
        .await
        .expect("enqueue");
    let mut later: Vec<MessageId> = Vec::new();
    for n in 1..=3 {
        later.push(
            outbox
                .enqueue(&db.client, &msg(&rabbit.exchange, "k", n))
                .await
                .expect("enqueue"),
        );
    }
    let others: Vec<Message> = (0..50)
        .map(|i| msg(&rabbit.exchange, &format!("o{i}"), i))
        .collect();
    outbox
        .enqueue_batch(&db.client, &others)
        .await
        .expect("enqueue");

    assert!(
        eventually(PATIENCE, || async { db.count("dead_letters").await == 1 }).await,
        "not dead-lettered"
    );
    assert!(
        eventually(PATIENCE, || async { rabbit.count() >= 50 }).await,
        "other keys blocked"
    );
    // `locate` names what a later message of the key waits for.
    let (code, out, _) = cli(db, &["locate", &later[0].to_string(), "--json"]).await;
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["state"], "parked", "{v}");
    assert_eq!(v["behind_dead_letter"], first.to_string(), "{v}");
    let (_, human, _) = cli(db, &["locate", &later[0].to_string()]).await;
    assert!(
        human.contains("parked behind dead letter") && human.contains(&first.to_string()),
        "{human}"
    );
    // Every recheck (`retry_max`), a relay's claim locks the parked rows for
    // a moment to set them aside again. `locate` in that moment must still
    // say why the message waits: a row behind its key's dead letter is
    // never at the broker. Held here as such a claim holds it.
    let claim = outbox_tests::db::connect(&db.config).await;
    claim.batch_execute("BEGIN").await.expect("begin");
    claim
        .execute(
            &format!(
                "SELECT 1 FROM {} WHERE message_id::text = $1 FOR UPDATE",
                db.table()
            ),
            &[&later[0].to_string()],
        )
        .await
        .expect("lock the parked row");
    let (code, out, _) = cli(db, &["locate", &later[0].to_string(), "--json"]).await;
    claim.batch_execute("ROLLBACK").await.expect("rollback");
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["state"], "parked", "locked for a moment by a claim: {v}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let ids = rabbit.message_ids();
    for id in &later {
        assert!(
            !ids.contains(&id.to_string()),
            "parked message {id} overtook the dead letter"
        );
    }
    let (code, out, _) = cli(db, &["status", "--json"]).await;
    assert_eq!(code, 0);
    let status: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(status["dead_letters"], 1);
    assert_eq!(status["parked_keys"][0]["key"], "k");
    assert_eq!(status["parked_keys"][0]["waiting"], 3);
    let (_, human, _) = cli(db, &["status"]).await;
    assert!(human.contains("parked key \"k\": 3 waiting"), "{human}");

    // Fix the binding: the test queue now also hears the side exchange.
    amqp::bind_fixture_queue(rabbit, side).await;
    let (code, out, err) = cli(
        db,
        &["dead-letters", "retry", "--key", "k", "--yes", "--json"],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&out).expect("json")["retried"],
        1
    );
    assert!(
        eventually(PATIENCE, || async { rabbit.count() >= 54 }).await,
        "key not unparked"
    );
    let order: Vec<String> = rabbit
        .message_ids()
        .into_iter()
        .filter(|id| *id == first.to_string() || later.iter().any(|l| l.to_string() == *id))
        .collect();
    let expected: Vec<String> = std::iter::once(first)
        .chain(later)
        .map(|i| i.to_string())
        .collect();
    assert_eq!(order, expected, "key k out of order after retry");
    assert_eq!(db.count("dead_letters").await, 0);
    setup.finish().await;
}

#[tokio::test]
async fn skip_setting_lets_later_messages_pass() {
    let setup = Setup::new(false).await;
    let (db, rabbit, side) = (&setup.db, &setup.rabbit, setup.side.as_str());
    let outbox = db.outbox();
    outbox
        .enqueue(&db.client, &msg(side, "k", 0))
        .await
        .expect("enqueue");
    for n in 1..=3 {
        outbox
            .enqueue(&db.client, &msg(&rabbit.exchange, "k", n))
            .await
            .expect("enqueue");
    }
    assert!(
        eventually(PATIENCE, || async { rabbit.count() >= 3 }).await,
        "skip mode still parks"
    );
    assert!(eventually(PATIENCE, || async { db.count("dead_letters").await == 1 }).await);
    setup.finish().await;
}

/// An app may enqueue a message id again once its first message has left the
/// outbox (the client's `message_id` makes an enqueue idempotent), and the
/// first may have left as a dead letter. Before, when the second failed for
/// good too, moving it to the dead letters broke their unique message id:
/// the whole settle rolled back, so its batch (other keys' messages
/// included) went out again at every claim and the key never moved.
#[tokio::test]
async fn a_message_id_dead_lettered_twice_repeats_nothing_and_stalls_nothing() {
    let setup = Setup::new(true).await;
    let (db, side) = (&setup.db, setup.side.as_str());
    let outbox = db.outbox();
    let reused = MessageId::from(uuid::Uuid::now_v7());
    let poison = |key: &str| {
        Message::builder(side)
            .key(key)
            .message_id(reused)
            .json(&0)
            .build()
            .expect("valid")
    };
    outbox
        .enqueue(&db.client, &poison("p"))
        .await
        .expect("enqueue");
    assert!(
        eventually(PATIENCE, || async { db.count("dead_letters").await == 1 }).await,
        "the first message was not dead-lettered"
    );
    // The id again (another key: the first one's is parked), among
    // messages of other keys.
    failing_amid_others(&setup, poison("q"), 2).await;
    // Both stay listed under the id, for the operator to retry or discard.
    let (code, out, err) = cli(
        db,
        &[
            "dead-letters",
            "list",
            "--id",
            &reused.to_string(),
            "--json",
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let listed: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(listed.as_array().map(Vec::len), Some(2), "{listed}");
    // `locate` answers with the newest; it failed with "query returned an
    // unexpected number of rows" and exit 1, README's "found nowhere".
    let (code, out, err) = cli(db, &["locate", &reused.to_string(), "--json"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let located: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(located["state"], "dead_lettered", "{located}");
    assert_eq!(located["key"], "q", "the newest dead letter: {located}");
    setup.finish().await;
}

/// A row whose headers Postgres holds but the relay cannot read back: a
/// plain-SQL writer's `{"n": 1e400}` (no f64 holds it) or JSON nested past
/// any parser's depth limit. Before, reading it failed the whole claim, the
/// worker's session started over and claimed it again, for good: nothing
/// of its partitions went out, and readiness still said ready. It fails on
/// its own account now: it goes to the dead letters, naming why, its key's
/// later rows wait behind it (parked), and the rest flow.
#[tokio::test]
async fn a_row_whose_headers_cannot_be_read_is_dead_lettered_and_stalls_nothing() {
    let setup = Setup::new(true).await;
    let (db, rabbit) = (&setup.db, &setup.rabbit);
    let outbox = db.outbox();
    let first: Vec<Message> = (0..5)
        .map(|i| msg(&rabbit.exchange, &format!("k{}", i % 3), i))
        .collect();
    outbox
        .enqueue_batch(&db.client, &first)
        .await
        .expect("enqueue");
    let deep = format!("{}1{}", "[".repeat(200), "]".repeat(200));
    for headers in [
        r#"{"n": 1e400}"#.to_owned(),
        format!(r#"{{"deep": {deep}}}"#),
    ] {
        db.client
            .execute(
                &format!(
                    "INSERT INTO {} (destination, ordering_key, headers, payload) \
                     VALUES ($1, 'bad', $2::text::jsonb, 'x')",
                    db.table()
                ),
                &[&rabbit.exchange, &headers],
            )
            .await
            .expect("a row with unreadable headers");
    }
    let after: Vec<Message> = (5..25)
        .map(|i| msg(&rabbit.exchange, &format!("k{}", i % 3), i))
        .collect();
    outbox
        .enqueue_batch(&db.client, &after)
        .await
        .expect("enqueue");
    let flowed = eventually(Duration::from_secs(30), || async {
        rabbit.count() >= 25 && db.count("dead_letters").await >= 1
    })
    .await;
    assert!(
        flowed,
        "{} of 25 delivered, {} dead letters, {} rows waiting",
        rabbit.count(),
        db.count("dead_letters").await,
        db.pending().await
    );
    // The first is a dead letter, naming why; the second waits behind it.
    let errors: Vec<String> = db
        .column(&format!(
            "SELECT last_error FROM {}.dead_letters",
            db.schema.quoted()
        ))
        .await;
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].contains("cannot be read") && errors[0].contains("out of range"),
        "{errors:?}"
    );
    assert_eq!(db.pending().await, 1);
    // The operator can list it, and sees the headers as stored (Postgres
    // writes 1e400 out in full).
    let (code, out, err) = cli(db, &["dead-letters", "list", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(r#""headers": "{\"n\": 1000"#), "{out}");
    setup.finish().await;
}

/// Dead letters kept across a sequence set back (`TRUNCATE ... RESTART
/// IDENTITY`, `setval`), which the relay follows: a new row that fails for
/// good takes a seq an old dead letter still has. Before, moving it there
/// broke the dead letters' key on seq, the settle of its batch rolled
/// back, and the batch (other keys' messages included) went out again at
/// every claim, for as long as the old dead letter stayed.
#[tokio::test]
async fn a_sequence_set_back_under_old_dead_letters_repeats_nothing() {
    let setup = Setup::new(false).await;
    let (db, side) = (&setup.db, setup.side.as_str());
    let outbox = db.outbox();
    let poison: Vec<Message> = (0..3).map(|i| msg(side, &format!("p{i}"), i)).collect();
    outbox
        .enqueue_batch(&db.client, &poison)
        .await
        .expect("enqueue");
    assert!(
        eventually(PATIENCE, || async { db.count("dead_letters").await == 3 }).await,
        "the first messages were not dead-lettered"
    );
    db.client
        .batch_execute(&format!("TRUNCATE {} RESTART IDENTITY", db.table()))
        .await
        .expect("restart the sequence");
    // Seq 1 again, for good a failure, among messages of other keys.
    failing_amid_others(&setup, msg(side, "q", 0), 4).await;
    setup.finish().await;
}
