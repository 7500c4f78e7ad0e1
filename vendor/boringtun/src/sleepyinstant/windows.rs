pub(crate) use std::time::Instant;
