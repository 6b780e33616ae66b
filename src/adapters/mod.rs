//! Adapters do the IO around the sans-IO cores: the offline replay (virtual clock, trace
//! readers, log writer thread) and live mode (worker processes on wall clocks over TCP).

pub mod live;
pub mod replay;
