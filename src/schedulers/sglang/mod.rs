//! SGLang-like engine core: pages, a radix prefix cache with lock references, a request-slot
//! pool, `new_token_ratio` admission with retraction, chunked prefill, destination
//! pre-allocation (the destination-first handoff) and source pinning.
//!
//! ## Resources
//! * **Pages** of `page_size` tokens (default 64: SGLang's own default is 1, but 64 is what
//!   deployments often run, costs 1/64 of the bookkeeping, and equals the reference mocker's
//!   block size). A page's content is named by its chained hash: prompt pages by
//!   [`Request::prompt_block_hashes`](crate::schedulers::Request::prompt_block_hashes), pages
//!   reached by decoding by [`decode_block_hash`](crate::schedulers::request::decode_block_hash).
//! * **The radix cache**: one node per full page, keyed by its hash (which covers the parent).
//!   Every holder locks its whole root path, so unlocked nodes are exactly the evictable ones;
//!   eviction takes unlocked leaves in LRU order and publishes `KvRemoved`. Computed pages are
//!   inserted after each prefill chunk (and decode pages when a request finishes or is
//!   retracted), publishing `KvStored{parent, blocks}` for the nodes that are new; a page whose
//!   hash is already cached is a duplicate: the holder adopts the cached node and its copy is
//!   freed.
//! * **Request slots** (`max_running_requests`): chunking, running, waiting-with-KV
//!   (activated destinations before they join the batch), reserved (pre-allocated and
//!   transferring) and pinned-source requests each hold one. Waiting requests without KV do not.
//!   Slots travel in `KvDelta::slots`, never as blocks.
//! * **Decode headroom**: each destination reservation books `num_reserved_decode_tokens`
//!   (`KvDelta::headroom_tokens`) until its request's terminal outcome. It gates admission only;
//!   nothing is allocated for it.
//!
//! ## Classes and sharing
//! `active`, `pinned_source`, `reserved_destination`, `cached_free` and `free` are exclusive.
//! A page several holders share counts once, by precedence **active > reserved > pinned**
//! (compute use first; a reservation's page becomes active at activation; a pin only blocks
//! eviction). A reservation's locked prefix pages that nobody else holds are therefore
//! `reserved_destination` (they leave `cached_free`: they can no longer be evicted), and
//! `DestinationReserved.pages` counts only the fresh delta pages. When a lock or unlock changes a
//! shared page's class, the move is in the delta of the fact that caused it.
//!
//! ## Scheduling (one step = one forward pass)
//! 1. Activated destinations (the prebuilt queue) join the decode batch (`RequestScheduled`
//!    with `cached_tokens = input`, no forward pass for them).
//! 2. Prefill has priority, as in SGLang without mixed chunks: the request being chunked
//!    continues first; then waiting requests are admitted FIFO while a slot is free and the
//!    budgets hold — `max_prefill_tokens` (the first request may exceed it),
//!    `chunked_prefill_size` (one chunked request at a time, non-final chunks page-aligned) and
//!    the token budget: free + evictable tokens minus `new_token_ratio` × the clipped remaining
//!    output of every decoding request must cover the candidate's uncached prompt plus its
//!    clipped remaining output. The prefix match always leaves at least one token to compute.
//! 3. Otherwise the batch decodes one token per request. If the pages for that growth are not
//!    available, requests are retracted — fewest output tokens first (then the longer prompt,
//!    then the newest) — their computed pages go back to the cache, their slots free, and they
//!    return to the front of the waiting queue (`RequestPreempted`); `new_token_ratio` resets
//!    to its initial value. Each decode pass without retraction lowers the ratio linearly
//!    from `init_new_token_ratio` to `min_new_token_ratio` over `new_token_ratio_decay_steps`.
//! 4. The last prompt chunk samples the first token (`FirstTokenEmitted`); a request ends
//!    `Completed` once it has `output_tokens` tokens (at least one).
//!
//! Facts follow the timing convention of [`crate::schedulers`]: allocations of new admissions
//! ride on their `RequestScheduled`, chunk continuations, decode growth and duplicate pages on
//! the `StepExecuted`, and the results (first tokens, pins, completions) come after it with
//! their own deltas. Per-step work is O(running requests + admitted prompt pages), never
//! O(total pages).
//!
//! ## Destination (pre-allocation)
//! `reserve_destination` needs a free slot and no retracted request waiting; it matches the
//! local radix prefix for the whole prompt (a full hit is allowed: nothing to compute here),
//! and admits iff the page-rounded `max(input − prefix + R, input − prefix + min(max_new, clip)
//! − retractable)` fits in the free + evictable tokens (after locking the prefix) minus
//! `R × (running + chunking + prebuilt + reserved)`, with `R = num_reserved_decode_tokens` and
//! `retractable` the tokens of the running batch. On success it locks the prefix, allocates
//! fresh pages only for the missing page-aligned prompt (unpublished, outside the tree), takes
//! a slot and books `R` headroom tokens (`DestinationReserved` + the output). Otherwise the
//! reservation waits in a bounded FIFO (`ReservationQueued`, `ReservationRefused{NoSlot |
//! NoCapacity}`, `Ok(Unavailable)`); a reservation arriving behind a non-empty FIFO queues
//! without trying. At the end of every command and step, only the head is retried, and only
//! if the capacity epoch (pages returning to free/cached, slots or headroom returned, retracted
//! requests re-admitted) moved since its last attempt.
//!
//! `activate_destination` turns the reservation active, inserts the received full pages into the
//! tree (one `KvStored` for the new pages; the reused prefix is not republished; the partial
//! last page stays private) and queues the retained request as prefilled, with its first token
//! (sampled by the source) counted: it decodes the remaining `output_tokens − 1`, never
//! recomputing the prompt. `cancel_destination` dequeues a pending reservation
//! (`ReservationDequeued`), releases a reserved one (`ReservationReleased`: prefix unlocked,
//! delta pages freed without entering the cache, slot and headroom returned), or aborts an
//! activated request like any other (`RequestFinished{Canceled}`). Headroom returns exactly
//! once, at the request's terminal outcome.
//!
//! ## Source
//! `submit_handoff_prefill` queues an ordinary prefill that stops after its first token. Its
//! last chunk inserts the pages into the tree and, in the same step, the request leaves the
//! batch holding its locks and slot (`SourcePinned`: active → pinned for the pages only it
//! holds, deadline = step end + lease). `release_source` unlocks (pages stay cached), frees the
//! partial page and the slot (`SourceReleased`). `cancel_source` works in every phase: queued or
//! computing requests end `Canceled`; a pinned one is released with reason `Canceled`.
//!
//! ## Limits and choices
//! * The waiting queue (`max_waiting_requests`) and the pre-allocation FIFO
//!   (`max_pending_reservations`) are bounded; over the bound a request is rejected
//!   (`RequestRejected{NoCapacity}`) and a reservation fails (`ReservationFailed{NoCapacity}`).
//! * A request whose full sequence (`input + max(output, 1)`, and `input + R` for a
//!   destination) exceeds the worker is refused at once with `NeverFits`.
//! * Request ids must be unique among requests live on one core (the scheduler-view fold keys by
//!   them); the core itself keys its state by internal slots and never panics on a duplicate.
//! * Handoff prefills end at their pin: no `RequestFinished` is emitted for them.
//! * Commands naming a handoff follow the rule both cores share
//!   ([`crate::schedulers::handoffs`]): ended → `NoOp`, never seen → `UnknownHandoff`, a start
//!   of an id held or ended → `DuplicateHandoff`; a refused start counts as ended.

pub mod config;
mod core;
mod radix;

pub use self::config::{ConfigError, SglangConfig};
pub use self::core::SglangCore;

#[cfg(test)]
mod tests;
