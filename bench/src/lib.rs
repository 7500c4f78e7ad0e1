//! Shared fixtures for the benches.
