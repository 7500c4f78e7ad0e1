//! What kg serves on `--listen`: Kilo's `/health`, `/metrics` and `/graph`, and kilotun's
//! `/status` (with its path probes). Nothing here changes the host; it reads the engine, the
//! kernel and what the pipeline last published.

pub mod http;
pub mod metrics;
pub mod probe;
pub mod route_lines;
pub mod status;
