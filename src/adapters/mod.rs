//! Adapters do the IO: clocks, replay (virtual time, trace readers), live (processes, transport).

pub mod replay;
