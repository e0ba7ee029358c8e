//! Prompt normalization (http-api §3.3) and the index lookup of its blocks.

use std::sync::atomic::Ordering;

use kv_types::{BlockHash, HashOptions, SequenceHash, TrackingScope};
use selection_policy::{PickRng, RouterConfigOverride};

use super::partition::{Partition, SelectScratch};
use super::{SelectionCore, clock_seed};
use crate::error::SelectionError;
use crate::request::{PromptInput, SelectRequest};

pub(super) fn check_hash_only(
    blocks: &[u64],
    seqs: &[u64],
    isl: u64,
) -> Result<(), SelectionError> {
    if isl == 0 {
        return Err(SelectionError::bad_request(
            "isl_tokens must be greater than 0",
        ));
    }
    if blocks.len() != seqs.len() {
        return Err(SelectionError::bad_request(format!(
            "block_hashes length {} must match sequence_hashes length {}",
            blocks.len(),
            seqs.len()
        )));
    }
    Ok(())
}

impl SelectionCore {
    /// Hashes the prompt into `scratch` and looks up its overlap (moved out of `schedule`
    /// so admission can do it once and `schedule` reuse it); returns the ISL. `dense_ok`:
    /// see [`SelectionCore::find_overlap`].
    pub(super) fn lookup_overlap(
        &self,
        partition: &Partition,
        req: &SelectRequest,
        scratch: &mut SelectScratch,
        dense_ok: bool,
    ) -> Result<u64, SelectionError> {
        let over = &req.router_config_override;
        let isl = self.normalize_prompt(partition, &req.prompt, over, true, scratch)?;
        if let Some(pin) = req.pinned_worker
            && let Some(allowed) = &req.allowed_worker_ids
            && !allowed.contains(&pin.worker_id.0)
        {
            return Err(SelectionError::bad_request(format!(
                "pinned worker {} is not in allowed worker set",
                pin.worker_id
            )));
        }
        self.find_overlap(partition, scratch, dense_ok);
        Ok(isl)
    }

    /// The lookup of `scratch.blocks` (placed on roster rows by `schedule`): per worker slot
    /// when `dense_ok` and the index allows it, else tiered (what `tiered()` readers need).
    pub(super) fn find_overlap(
        &self,
        partition: &Partition,
        scratch: &mut SelectScratch,
        dense_ok: bool,
    ) {
        scratch
            .hits
            .find(&partition.index.read(), &scratch.blocks, dense_ok);
    }

    /// Fills `scratch.blocks` / `scratch.tracking` and returns the normalized ISL.
    pub(super) fn normalize_prompt(
        &self,
        partition: &Partition,
        prompt: &PromptInput,
        over: &RouterConfigOverride,
        selection_rules: bool,
        scratch: &mut SelectScratch,
    ) -> Result<u64, SelectionError> {
        scratch.tracking_is_chain = false;
        if let Some((tokens, mm)) = prompt.routing_tokens() {
            if tokens.len() > self.config.max_prompt_tokens {
                return Err(SelectionError::new(
                    crate::ErrorKind::BadRequest,
                    413,
                    format!(
                        "prompt has {} tokens; the maximum is {}",
                        tokens.len(),
                        self.config.max_prompt_tokens
                    ),
                ));
            }
            let is_eagle = prompt.is_eagle.unwrap_or(partition.is_eagle);
            let opts = HashOptions {
                lora_name: prompt.lora_name.as_deref(),
                cache_salt: prompt.cache_salt.as_deref(),
                is_eagle,
                block_mm_infos: mm,
            };
            let reuse = self.config.router.assume_kv_reuse(over);
            if reuse && matches!(self.config.tracking, kv_types::TrackingHasher::Public) {
                // Public tracking hashes are the sequence chain of the block hashes.
                kv_types::prompt_hashes_into(
                    tokens,
                    partition.block_size,
                    &opts,
                    &mut scratch.blocks,
                    &mut scratch.tracking,
                );
                scratch.tracking_is_chain = true;
            } else if reuse {
                kv_types::block_hashes_into(
                    tokens,
                    partition.block_size,
                    &opts,
                    &mut scratch.blocks,
                );
                let scope = TrackingScope {
                    model_name: &partition.key.model_name,
                    routing_group: &partition.key.routing_group,
                    block_size: partition.block_size,
                    cache_salt: prompt.cache_salt.as_deref(),
                    lora_name: prompt.lora_name.as_deref(),
                    is_eagle,
                };
                self.config.tracking.tracking_hashes_into(
                    &scope,
                    tokens,
                    mm,
                    &scratch.blocks,
                    &mut scratch.tracking,
                );
            } else {
                kv_types::block_hashes_into(
                    tokens,
                    partition.block_size,
                    &opts,
                    &mut scratch.blocks,
                );
                scratch.tracking.clear();
                let mut rng =
                    PickRng::seeded(self.rng_seed.fetch_add(1, Ordering::Relaxed) ^ clock_seed());
                scratch
                    .tracking
                    .extend((0..scratch.blocks.len()).map(|_| SequenceHash(rng.next_u64())));
            }
            return Ok(tokens.len() as u64);
        }
        if selection_rules {
            let blocks = prompt.block_hashes.as_ref().ok_or_else(|| {
                SelectionError::bad_request("block_hashes is required without token_ids")
            })?;
            let seqs = prompt.sequence_hashes.as_ref().ok_or_else(|| {
                SelectionError::bad_request("sequence_hashes is required without token_ids")
            })?;
            let isl = prompt.isl_tokens.ok_or_else(|| {
                SelectionError::bad_request("isl_tokens is required without token_ids")
            })?;
            check_hash_only(blocks, seqs, isl)?;
            scratch.blocks.clear();
            scratch.blocks.extend(blocks.iter().map(|&h| BlockHash(h)));
            scratch.tracking.clear();
            scratch
                .tracking
                .extend(seqs.iter().map(|&h| SequenceHash(h)));
            Ok(isl)
        } else {
            let seqs = prompt.sequence_hashes.as_ref().ok_or_else(|| {
                SelectionError::bad_request("sequence_hashes is required without token_ids")
            })?;
            let isl = prompt.isl_tokens.ok_or_else(|| {
                SelectionError::bad_request("isl_tokens is required without token_ids")
            })?;
            // An index recording routing decisions needs block hashes consistent with the
            // sequence hashes; the explicit form checks that after the worker (http-api §6.1
            // step 6), see `create_reservation_inner`.
            scratch.blocks.clear();
            if let Some(blocks) = &prompt.block_hashes {
                scratch.blocks.extend(blocks.iter().map(|&h| BlockHash(h)));
            }
            scratch.tracking.clear();
            scratch
                .tracking
                .extend(seqs.iter().map(|&h| SequenceHash(h)));
            Ok(isl)
        }
    }
}
