//! Routers: KV index from Stored/Removed facts, selection modes, bookings.
