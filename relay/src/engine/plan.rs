//! The pure part of a batch: which messages may go to the broker together
//! (waves), and what to do with each row once the broker has answered
//! (settle). No I/O but the publisher call; unit-tested below.

use std::collections::HashSet;
use std::time::Duration;

use super::Settings;
use crate::backoff::delay_for;
use crate::envelope::{Envelope, Receipt};
use crate::publish::{Publisher, Verdict};

/// What to do with each row of a published batch.
#[derive(Debug, Default, PartialEq)]
pub(super) struct SettlePlan<'a> {
    /// Confirmed rows, with what the broker said.
    pub(super) published: Vec<(&'a Envelope, Receipt)>,
    pub(super) failed: Vec<(i64, String, Duration)>,
    pub(super) dead: Vec<(i64, String)>,
    pub(super) held: usize,
    /// Rows the broker left unanswered while it confirmed others, and why:
    /// set aside for a short while, no attempt counted.
    pub(super) unanswered: Vec<(i64, String)>,
    /// The longest any of them asked to be set aside (`Rejection::wait`).
    pub(super) unanswered_wait: Duration,
}

/// Which wave each message of `batch` goes out in. A key's messages stay in one
/// wave while they share a lane; a lane change moves the rest of the key to the
/// next wave. Messages without a key all go in the first.
pub(super) fn plan_waves<P: Publisher>(publisher: &P, batch: &[Envelope]) -> Vec<usize> {
    let mut last: std::collections::HashMap<&str, (usize, usize)> =
        std::collections::HashMap::new();
    batch
        .iter()
        .enumerate()
        .map(|(i, env)| {
            let Some(key) = env.ordering_key.as_deref() else {
                return 0;
            };
            let wave = match last.get(key) {
                None => 0,
                Some(&(prev, w)) if publisher.same_lane(&batch[prev], env) => w,
                Some(&(_, w)) => w + 1,
            };
            last.insert(key, (i, wave));
            wave
        })
        .collect()
}

/// Publishes `batch` wave by wave (usually one wave): a wave goes out only after
/// the previous one is answered, and a key refused in one wave sends nothing in
/// later ones. `None` marks a message held back unsent.
///
/// Only the first wave's failure fails the batch. What earlier waves had
/// confirmed stands when a later one fails (its messages are unanswered,
/// the rest unsent), and no wave starts with less time left before
/// `deadline` than the last one took: a key that changes lanes at every
/// message, on a broker slow to confirm, sent waves until one was cut at
/// the deadline, and the batch failed whole, its confirmed waves sent
/// again at every claim, the key never drained.
pub(super) async fn publish_in_waves<P: Publisher>(
    publisher: &P,
    batch: &[Envelope],
    deadline: tokio::time::Instant,
) -> Result<Vec<Option<Verdict>>, crate::publish::PublishError> {
    let waves = plan_waves(publisher, batch);
    let last_wave = waves.iter().copied().max().unwrap_or(0);
    if last_wave == 0 {
        return Ok(publisher
            .publish_until(batch, deadline)
            .await?
            .into_iter()
            .map(Some)
            .collect());
    }
    let mut outcomes: Vec<Option<Verdict>> = vec![None; batch.len()];
    let mut refused: HashSet<&str> = HashSet::new();
    // How long the last wave took: a wave is not started with less time
    // left than that, or it would be cut unanswered (on RabbitMQ, taking
    // the connection and the other batches' confirms with it).
    let mut took = std::time::Duration::ZERO;
    for wave in 0..=last_wave {
        let members: Vec<usize> = (0..batch.len())
            .filter(|&i| waves[i] == wave)
            .filter(|&i| {
                batch[i]
                    .ordering_key
                    .as_deref()
                    .is_none_or(|k| !refused.contains(k))
            })
            .collect();
        if members.is_empty() {
            continue;
        }
        let started = tokio::time::Instant::now();
        if wave > 0 && started + took >= deadline {
            break;
        }
        let sub: Vec<Envelope> = members.iter().map(|&i| batch[i].clone()).collect();
        let answers = match publisher.publish_until(&sub, deadline).await {
            Ok(answers) => answers,
            Err(e) if wave == 0 => return Err(e),
            Err(e) => {
                // The batch stands on its earlier waves; the next batch
                // meets the broker's state at its first.
                tracing::warn!(wave, error = %e, "a later wave of a batch failed; what earlier waves confirmed stands");
                if e.is_unsent() {
                    break;
                }
                let reason = e.to_string();
                for &i in &members {
                    outcomes[i] = Some(Err(crate::publish::Rejection::unanswered(reason.clone())));
                }
                break;
            }
        };
        took = started.elapsed();
        for (&i, answer) in members.iter().zip(answers) {
            if answer.is_err() {
                if let Some(k) = batch[i].ordering_key.as_deref() {
                    refused.insert(k);
                }
            }
            outcomes[i] = Some(answer);
        }
    }
    Ok(outcomes)
}

/// Confirmed rows are deleted, rejected ones get an attempt recorded and a
/// backoff, unanswered ones are set aside without an attempt. Once a row of a key is rejected, the key's later rows are left as
/// they are: unsent ones (`None`) wait, and confirmed ones — possible only if the
/// broker refused one message of a lane and accepted the next — are not deleted
/// either, so they are published again after the refused one.
pub(super) fn settle_plan<'a>(
    batch: &'a [Envelope],
    outcomes: &[Option<Verdict>],
    settings: &Settings,
) -> SettlePlan<'a> {
    let mut plan = SettlePlan::default();
    let mut blocked: HashSet<&str> = HashSet::new();
    for (env, outcome) in batch.iter().zip(outcomes) {
        if let Some(key) = env.ordering_key.as_deref() {
            if blocked.contains(key) {
                plan.held += 1;
                continue;
            }
        }
        let Some(outcome) = outcome else {
            plan.held += 1;
            continue;
        };
        match outcome {
            Ok(receipt) => plan.published.push((env, *receipt)),
            Err(rejection) => {
                if rejection.unanswered {
                    plan.unanswered.push((env.seq, rejection.reason.clone()));
                    plan.unanswered_wait =
                        plan.unanswered_wait.max(rejection.wait.unwrap_or_default());
                } else if rejection.permanent || env.attempts + 1 >= settings.max_attempts {
                    plan.dead.push((env.seq, rejection.reason.clone()));
                } else {
                    let attempt = u32::try_from(env.attempts).unwrap_or(0);
                    let delay = delay_for(settings.retry_base, settings.retry_max, attempt);
                    plan.failed.push((env.seq, rejection.reason.clone(), delay));
                }
                if let Some(key) = env.ordering_key.as_deref() {
                    blocked.insert(key);
                }
            }
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::publish::Rejection;
    use std::time::SystemTime;

    fn env(seq: i64, key: Option<&str>) -> Envelope {
        Envelope {
            seq,
            message_id: uuid::Uuid::now_v7(),
            destination: "d".into(),
            ordering_key: key.map(str::to_owned),
            routing_key: String::new(),
            headers: vec![],
            payload: vec![],
            content_type: None,
            event_type: None,
            created_at: SystemTime::now(),
            attempts: 0,
        }
    }

    fn seqs(published: &[(&Envelope, Receipt)]) -> Vec<i64> {
        published.iter().map(|p| p.0.seq).collect()
    }

    fn routed(seq: i64, key: &str, rk: &str) -> Envelope {
        Envelope {
            routing_key: rk.into(),
            ..env(seq, Some(key))
        }
    }

    #[test]
    fn a_lane_change_starts_a_new_wave_for_that_key_only() {
        let p = crate::publish::memory::MemoryPublisher::new();
        let batch = vec![
            routed(1, "a", "x"),
            routed(2, "b", "x"),
            routed(3, "a", "x"),
            routed(4, "a", "y"),
            env(5, None),
            routed(6, "a", "y"),
            routed(7, "a", "x"),
        ];
        assert_eq!(plan_waves(&p, &batch), vec![0, 0, 0, 1, 0, 1, 2]);
    }

    /// A broker that takes `each` to answer a wave, and fails every wave
    /// from the `fail_from`th on (a connection lost, a channel closed).
    struct Waves {
        each: std::time::Duration,
        fail_from: usize,
        calls: std::sync::Mutex<usize>,
    }

    impl Waves {
        fn new(each_ms: u64, fail_from: usize) -> Self {
            Waves {
                each: std::time::Duration::from_millis(each_ms),
                fail_from,
                calls: std::sync::Mutex::new(0),
            }
        }

        fn calls(&self) -> usize {
            *self.calls.lock().expect("calls")
        }
    }

    impl Publisher for Waves {
        async fn publish(
            &self,
            batch: &[Envelope],
        ) -> Result<Vec<Verdict>, crate::publish::PublishError> {
            let call = {
                let mut calls = self.calls.lock().expect("calls");
                *calls += 1;
                *calls - 1
            };
            tokio::time::sleep(self.each).await;
            if call >= self.fail_from {
                return Err(crate::publish::PublishError::msg("connection lost"));
            }
            Ok(batch.iter().map(|_| Ok(Receipt::Memory)).collect())
        }

        async fn ready(&self) -> Result<(), crate::publish::PublishError> {
            Ok(())
        }

        async fn close(&self) {}
    }

    /// Key `k` changes lanes at every message (routing keys taking turns,
    /// `order.created` then `order.paid`), `o` stays in the first wave.
    fn turns(n: i64) -> Vec<Envelope> {
        let mut batch: Vec<Envelope> = (1..=n)
            .map(|i| routed(i, "k", if i % 2 == 0 { "b" } else { "a" }))
            .collect();
        batch.push(routed(n + 1, "o", "a"));
        batch
    }

    /// A later wave that fails (the connection lost while it was out) took
    /// the whole batch with it: the first wave's confirms, every other key
    /// of the batch, were thrown away and sent again, and on a broker
    /// slow enough for the waves to outlast the batch's time, at every
    /// claim, for good. What was confirmed stands; the failed wave's rows
    /// are unanswered (sent again, no attempt counted), later ones unsent.
    #[tokio::test(start_paused = true)]
    async fn a_later_wave_failing_keeps_the_earlier_waves_confirms() {
        let p = Waves::new(100, 1);
        let batch = turns(3);
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
        let outcomes = publish_in_waves(&p, &batch, deadline)
            .await
            .expect("the first wave's confirms stand");
        assert!(matches!(outcomes[0], Some(Ok(_))), "{outcomes:?}");
        assert!(matches!(outcomes[3], Some(Ok(_))), "{outcomes:?}");
        assert!(
            matches!(&outcomes[1], Some(Err(r)) if r.unanswered),
            "{outcomes:?}"
        );
        assert!(outcomes[2].is_none(), "{outcomes:?}");
        let plan = settle_plan(&batch, &outcomes, &Settings::default());
        assert_eq!(seqs(&plan.published), vec![1, 4]);
        assert_eq!(plan.unanswered.len(), 1);
        assert_eq!(plan.held, 1);
        // A first wave that fails is the batch's failure, as before.
        let p = Waves::new(100, 0);
        assert!(publish_in_waves(&p, &batch, deadline).await.is_err());
    }

    /// No wave starts once the batch's time is up, nor with less time left
    /// than the last wave took: waves sent after it were cut at once,
    /// unanswered, and with them went the confirms of the waves before
    /// (above). The rows of the waves not sent wait, unsent, for the next
    /// claim, which takes up where this batch stopped.
    #[tokio::test(start_paused = true)]
    async fn no_wave_starts_once_the_batch_is_out_of_time() {
        let p = Waves::new(1_000, usize::MAX);
        let batch = turns(6);
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_millis(2_500);
        let outcomes = publish_in_waves(&p, &batch, deadline)
            .await
            .expect("published");
        // Waves at 0 s and 1 s; at 2 s a wave of 1 s would end past 2.5 s.
        assert_eq!(p.calls(), 2, "waves started: {outcomes:?}");
        assert!(outcomes[..2].iter().all(|o| matches!(o, Some(Ok(_)))));
        assert!(outcomes[2..6].iter().all(Option::is_none), "{outcomes:?}");
        assert!(matches!(outcomes[6], Some(Ok(_))));
    }

    #[tokio::test]
    async fn a_refused_message_is_never_overtaken_across_lanes() {
        let p = crate::publish::memory::MemoryPublisher::new();
        p.reject_destination("poison", Rejection::retryable("no route"));
        let first = Envelope {
            destination: "poison".into(),
            ..env(1, Some("k"))
        };
        let batch = vec![first, env(2, Some("k")), env(3, Some("other"))];
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
        let outcomes = publish_in_waves(&p, &batch, deadline)
            .await
            .expect("published");
        assert!(matches!(outcomes[0], Some(Err(_))));
        assert!(outcomes[1].is_none(), "k's second message must not be sent");
        assert!(matches!(outcomes[2], Some(Ok(_))));
        let sent: Vec<i64> = p.published().iter().map(|e| e.seq).collect();
        assert_eq!(sent, vec![3]);
        let plan = settle_plan(&batch, &outcomes, &Settings::default());
        assert_eq!(seqs(&plan.published), vec![3]);
        assert_eq!(plan.held, 1);
    }

    #[test]
    fn unanswered_rows_wait_without_an_attempt_and_hold_back_their_key() {
        // A row on its last attempt: a refusal would dead-letter it, an
        // unanswered send must not.
        let last = Envelope {
            attempts: Settings::default().max_attempts - 1,
            ..env(1, Some("a"))
        };
        let batch = vec![last, env(2, Some("b")), env(3, Some("a")), env(4, None)];
        let outcomes: Vec<Option<Verdict>> = vec![
            Err(Rejection::unanswered("partition offline")),
            Ok(Receipt::Memory),
            Ok(Receipt::Memory),
            Err(Rejection::unanswered("partition offline")),
        ]
        .into_iter()
        .map(Some)
        .collect();
        let plan = settle_plan(&batch, &outcomes, &Settings::default());
        assert_eq!(
            seqs(&plan.published),
            vec![2],
            "b's confirmed row is settled"
        );
        let unanswered: Vec<i64> = plan.unanswered.iter().map(|u| u.0).collect();
        assert_eq!(unanswered, vec![1, 4]);
        assert_eq!(plan.held, 1, "a's later row waits behind its head");
        assert!(plan.failed.is_empty(), "no attempt counted: {plan:?}");
        assert!(plan.dead.is_empty(), "never dead-lettered: {plan:?}");
    }

    #[test]
    fn a_rejection_holds_back_the_rest_of_its_key_only() {
        let batch = vec![
            env(1, Some("a")),
            env(2, Some("b")),
            env(3, Some("a")),
            env(4, None),
            env(5, Some("a")),
            env(6, Some("b")),
        ];
        let outcomes: Vec<Option<Verdict>> = vec![
            Err(Rejection::retryable("no route")),
            Ok(Receipt::Memory),
            Ok(Receipt::Memory),
            Err(Rejection::retryable("nack")),
            Ok(Receipt::Memory),
            Ok(Receipt::Memory),
        ]
        .into_iter()
        .map(Some)
        .collect();
        let plan = settle_plan(&batch, &outcomes, &Settings::default());
        assert_eq!(seqs(&plan.published), vec![2, 6]);
        assert_eq!(
            plan.failed.iter().map(|f| f.0).collect::<Vec<_>>(),
            vec![1, 4]
        );
        assert_eq!(plan.held, 2);
    }

    #[test]
    fn permanent_rejections_and_exhausted_attempts_go_to_dead_letters() {
        let settings = Settings::default();
        let mut tired = env(2, Some("k"));
        tired.attempts = settings.max_attempts - 1;
        let batch = [env(1, None), tired, env(3, None)];
        let plan = settle_plan(
            &batch,
            &[
                Some(Err(Rejection::permanent("too large"))),
                Some(Err(Rejection::retryable("no route"))),
                Some(Err(Rejection::retryable("no route"))),
            ],
            &settings,
        );
        assert_eq!(
            plan.dead.iter().map(|d| d.0).collect::<Vec<_>>(),
            vec![1, 2]
        );
        assert_eq!(plan.failed.iter().map(|f| f.0).collect::<Vec<_>>(), vec![3]);
    }
}
