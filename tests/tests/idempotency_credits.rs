//! The credits example (outbox-client/examples/credits.rs), against a real
//! Postgres: its delays and the environment variables that set them, and its
//! story, in which a client that times out and retries is granted credits
//! once and gets the original response.

use std::time::Duration;

use outbox_tests::db::TestDb;

#[allow(dead_code)] // its main() and the parts only main() uses
#[path = "../../outbox-client/examples/credits.rs"]
mod credits;

#[test]
fn credits_delays_default_to_the_story_and_read_the_env_names() {
    assert_eq!(
        credits::Delays::from_lookup(|_| None),
        Ok(credits::Delays::STORY)
    );
    assert_eq!(credits::Delays::STORY.handler, Duration::from_secs(6));
    assert_eq!(
        credits::Delays::STORY.client_timeout,
        Duration::from_secs(5)
    );
    let fast = credits::Delays::from_lookup(|name| match name {
        "CREDITS_HANDLER_DELAY_MS" => Some("600".into()),
        "CREDITS_CLIENT_TIMEOUT_MS" => Some("500".into()),
        _ => None,
    });
    assert_eq!(
        fast,
        Ok(credits::Delays {
            handler: Duration::from_millis(600),
            client_timeout: Duration::from_millis(500),
        })
    );
    let bad = credits::Delays::from_lookup(|name| {
        (name == "CREDITS_CLIENT_TIMEOUT_MS").then(|| "5s".to_owned())
    });
    assert!(bad.is_err_and(|e| e.contains("CREDITS_CLIENT_TIMEOUT_MS")));
}

#[tokio::test]
async fn credits_story_grants_once_and_the_retry_gets_the_original_response() {
    let db = TestDb::new().await;
    credits::create_tables(&db.client, &db.schema)
        .await
        .expect("tables");
    // The story, shortened. The handler's delay is a floor (a sleep), so the
    // first attempt cannot get an answer before the client gives up; later
    // attempts are not timed, only counted.
    let delays = credits::Delays {
        handler: Duration::from_millis(1500),
        client_timeout: Duration::from_millis(1000),
    };
    let pool = credits::pool(db.config.clone()).expect("pool");
    let (addr, server) = credits::serve(credits::App::new(pool, db.schema.clone(), delays.handler))
        .await
        .expect("serve");

    let attempts = credits::client_story(
        &format!("http://{addr}"),
        "alice",
        100,
        delays.client_timeout,
        20,
    )
    .await
    .expect("story");
    assert_eq!(
        attempts.first(),
        Some(&credits::Attempt::TimedOut),
        "{attempts:?}"
    );
    let Some(credits::Attempt::Answered {
        status: 201,
        replayed: true,
        body,
    }) = attempts.last()
    else {
        panic!("the client did not end with a replayed grant: {attempts:?}");
    };
    let grant: credits::Grant = serde_json::from_slice(body).expect("grant json");

    let grants = db
        .client
        .query(
            &format!(
                "SELECT grant_id FROM {}.credit_grants WHERE user_id = 'alice'",
                db.schema.quoted()
            ),
            &[],
        )
        .await
        .expect("grants");
    assert_eq!(grants.len(), 1, "credits granted once");
    assert_eq!(
        grant.grant_id,
        grants[0].get::<_, uuid::Uuid>(0),
        "the original response"
    );
    assert_eq!((grant.amount, grant.balance), (100, 100));
    let balance: i64 = db
        .client
        .query_one(
            &format!(
                "SELECT credits FROM {}.credit_accounts WHERE user_id = 'alice'",
                db.schema.quoted()
            ),
            &[],
        )
        .await
        .expect("balance")
        .get(0);
    assert_eq!(balance, 100);
    assert_eq!(db.pending().await, 1, "one credits.granted message");
    server.abort();
    db.cleanup().await;
}
