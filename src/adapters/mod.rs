//! Adapters do the IO around the sans-IO cores: today the offline replay (virtual clock, trace readers,
//! log writer thread). Live workers are not built yet.

pub mod replay;
