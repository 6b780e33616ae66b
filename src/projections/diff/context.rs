//! Context around a divergence: references to records (stream and byte offset) kept while
//! walking, re-read only for the divergence that is printed.

use super::report::ContextRecord;
use crate::events::segment::{read_record_at, records_around};
use crate::events::{LogError, RunLayout};
use std::collections::VecDeque;

/// A record to re-read for context: its stream and byte offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RecordRef {
    pub(super) stream: usize,
    pub(super) offset: u64,
}

/// The records to print around a divergence on one side.
pub(super) enum Context {
    /// These records.
    Refs(Vec<RecordRef>),
    /// `stream`'s records from offset `start` to `after` records past the one at `div`.
    Span { stream: usize, start: u64, div: u64, after: usize },
}

pub(super) fn resolve(
    layout: &RunLayout,
    ctx: &Context,
    div: Option<RecordRef>,
) -> Result<Vec<ContextRecord>, LogError> {
    let mut out = Vec::new();
    match ctx {
        Context::Refs(refs) => {
            for r in refs {
                let Some(seg) = layout.segment_of(r.stream) else {
                    continue;
                };
                let (_, record) = read_record_at(seg, r.offset)?;
                out.push(ContextRecord {
                    worker: layout.headers[r.stream].worker,
                    record,
                    divergent: Some(*r) == div,
                });
            }
        }
        Context::Span { stream, start, div: d, after } => {
            let Some(seg) = layout.segment_of(*stream) else {
                return Ok(out);
            };
            // A bounded read: in a merged file other streams' records lie in between.
            for (offset, record) in records_around(seg, *stream, *start, *d, *after, 1 << 20)? {
                out.push(ContextRecord {
                    worker: layout.headers[*stream].worker,
                    record,
                    divergent: offset == *d,
                });
            }
        }
    }
    Ok(out)
}

pub(super) fn push_ring(ring: &mut VecDeque<RecordRef>, cap: usize, r: RecordRef) {
    if ring.len() == cap {
        ring.pop_front();
    }
    ring.push_back(r);
}
