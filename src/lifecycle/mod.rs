//! Role-local handoff state machines (source, destination) and the messages between them.
