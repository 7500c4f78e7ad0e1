//! Records the target triple the binaries are built for, so `--version` and kg's startup log
//! can name it (a cross-built binary on the wrong host is otherwise only an `exec format error`).

fn main() {
    let target = std::env::var("TARGET").unwrap_or_else(|_| "unknown".to_string());
    println!("cargo:rustc-env=KILOTUN_TARGET={target}");
    println!("cargo:rerun-if-changed=build.rs");
}
