//! Offline replay: trace readers and transfer timing (the event loop comes later).

pub mod trace;
pub mod transfer;
