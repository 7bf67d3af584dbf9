//! The correctness suite's deliberately broken behaviours (feature
//! `mutants`), as the worker meets them: three calls that are no-ops
//! without the feature, and the ack-before-confirm mutant's own settle.

use super::plan::publish_in_waves;
use super::worker::{BatchEnd, BatchError, Worker};
use crate::envelope::Envelope;
use crate::health::Event;
use crate::publish::Publisher;
use crate::source::store::{BatchTx, Store};

/// The claimed batch, as the watermark mutant would cut it.
pub(super) fn claimed(batch: Vec<Envelope>) -> Vec<Envelope> {
    #[cfg(feature = "mutants")]
    return crate::mutants::apply_watermark(batch);
    #[cfg(not(feature = "mutants"))]
    batch
}

/// Whether the ack-before-confirm mutant is selected.
pub(super) fn settles_before_confirm() -> bool {
    #[cfg(feature = "mutants")]
    return crate::mutants::active() == Some(crate::mutants::Mutant::AckBeforeConfirm);
    #[cfg(not(feature = "mutants"))]
    false
}

/// The crash-after-ack failpoint.
pub(super) fn after_ack() {
    #[cfg(feature = "mutants")]
    crate::mutants::after_ack();
}

impl<P: Publisher, S: Store> Worker<P, S> {
    /// The ack-before-confirm mutant: deletes and commits, then publishes and
    /// ignores the answer. Only ever called when that mutant is selected.
    pub(super) async fn settle_before_confirm(
        &self,
        mut tx: impl BatchTx,
        batch: &[Envelope],
    ) -> Result<BatchEnd, BatchError> {
        let seqs: Vec<i64> = batch.iter().map(|e| e.seq).collect();
        tx.delete(&seqs).await?;
        tx.commit().await?;
        let deadline = tokio::time::Instant::now() + self.settings.hold_limit / 2;
        let _ = publish_in_waves(self.publisher.as_ref(), batch, deadline).await;
        self.stats.count(Event::Published, seqs.len() as u64);
        Ok(BatchEnd::Settled {
            more: true,
            late: false,
            cycle: None,
        })
    }
}
