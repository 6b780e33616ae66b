//! The shared vocabulary, below every other layer: what a request is and its block hashes
//! ([`request`]), a change of physical KV ownership ([`delta`]), a worker's physical KV at an
//! instant ([`capacity`]) and its scheduler queues as counts ([`view`]). Ids, roles and policies
//! are in [`crate::ids`], the one module this layer uses.
//!
//! The layering it makes possible (checked by the test below): the log (`events`), the engine
//! cores (`schedulers`) and the router import nothing from `projections`; `projections` and
//! `router` import nothing from `schedulers`; the SGLang core imports nothing from the vLLM core.

pub mod capacity;
pub mod delta;
pub mod request;
pub mod view;

pub use capacity::KvCapacitySnapshot;
pub use delta::KvDelta;
pub use request::{BlockHash, Request};
pub use view::SchedulerView;

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let p = entry.unwrap().path();
            if p.is_dir() {
                rust_files(&p, out);
            } else if p.extension().is_some_and(|e| e == "rs")
                && p.file_name().is_some_and(|n| n != "tests.rs")
            {
                out.push(p);
            }
        }
    }

    /// Every `crate::FORBIDDEN` path written in code (not comments) under `src/LAYER`. A unit-test
    /// module (`tests.rs`) may check its layer against the folds above it, so it is not read.
    fn uses(layer: &str, forbidden: &str) -> Vec<String> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src").join(layer);
        let mut files = Vec::new();
        rust_files(&root, &mut files);
        let needle = format!("crate::{forbidden}");
        let mut found = Vec::new();
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap();
            for (n, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                if code.contains(&needle) {
                    found.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
                }
            }
        }
        found
    }

    #[test]
    fn lower_layers_do_not_import_higher_ones() {
        let rules = [
            ("events", "projections"),
            ("events", "schedulers"),
            ("lifecycle", "projections"),
            ("lifecycle", "schedulers"),
            ("schedulers", "projections"),
            ("router", "projections"),
            ("projections", "schedulers"),
            ("router", "schedulers"),
            ("schedulers/sglang", "schedulers::vllm"),
            ("model", "events"),
            ("model", "schedulers"),
            ("model", "projections"),
            ("model", "router"),
            // The runtime is shared by replay and live: it knows neither, nor the folds.
            ("runtime", "adapters"),
            ("runtime", "projections"),
            ("schedulers", "runtime"),
            ("router", "runtime"),
            ("lifecycle", "runtime"),
            ("events", "runtime"),
        ];
        let broken: Vec<String> = rules.iter().flat_map(|(layer, bad)| uses(layer, bad)).collect();
        assert!(broken.is_empty(), "layering broken:\n{}", broken.join("\n"));
    }
}
