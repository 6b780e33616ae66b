//! `handoff-log compare` end to end, through the binary, on replays of the committed fixtures:
//! the cascade trace (`fixtures/traces/cascade.jsonl` with `fixtures/configs/cascade.json`,
//! 2 prefill + 2 decode workers), where vLLM strands prefill KV and SGLang does not, and the
//! 200-line Mooncake sample. Also the goodput objectives (`--slo`) of `replay` and `compare`,
//! and the run id's derivation from trace, configuration and seed. And `handoff-log sweep`:
//! how grids expand, that its runs are byte for byte the lone replays' whatever the job count,
//! shards, and what it refuses.

mod support;

use handoff_ledger::adapters::replay::config::ReplayConfig;
use handoff_ledger::adapters::replay::sweep::{label, plan, Grid, Shard};
use handoff_ledger::adapters::replay::transfer::TransferConfig;
use handoff_ledger::ids::Backend;
use handoff_ledger::router::RouterMode;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use support::e2e::{cli, fixture, replay};

fn cascade(backend: &str, out: &Path, extra: &[&str]) -> Value {
    let config = fixture("configs/cascade.json");
    let args = [&["--backend", backend, "--config", config.to_str().unwrap()], extra].concat();
    replay("traces/cascade.jsonl", &args, out)
}

/// Runs `compare` and returns stdout; panics with stderr unless it exits 0.
fn compare(runs: &[&Path], extra: &[&str]) -> String {
    let o = cli().arg("compare").args(runs).args(extra).output().unwrap();
    assert!(o.status.success(), "compare failed: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

fn compare_json(runs: &[&Path], extra: &[&str]) -> Value {
    serde_json::from_str(&compare(runs, &[extra, &["--json"]].concat())).unwrap()
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// The CSV as one map per line (header names to fields). The fixtures' fields hold no commas.
fn parse_csv(text: &str) -> Vec<BTreeMap<String, String>> {
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    lines
        .map(|l| {
            let fields: Vec<&str> = l.split(',').collect();
            assert_eq!(fields.len(), header.len(), "{l}");
            header.iter().map(|h| h.to_string()).zip(fields.iter().map(|f| f.to_string())).collect()
        })
        .collect()
}

/// The cells of the table row whose first cell is `label`.
fn row<'a>(table: &'a str, label: &str) -> Vec<&'a str> {
    let line = table
        .lines()
        .find(|l| l.trim_start_matches(['│', ' ']).starts_with(&format!("{label} ")))
        .unwrap_or_else(|| panic!("no row {label} in\n{table}"));
    line.split(['│', '┆']).map(str::trim).filter(|c| !c.is_empty()).collect()
}

#[test]
fn vllm_strands_more_than_sglang_and_every_format_says_the_same() {
    let t = tempfile::tempdir().unwrap();
    let (vllm, sglang) = (t.path().join("cascade-vllm"), t.path().join("cascade-sglang"));
    cascade("vllm", &vllm, &[]);
    cascade("sglang", &sglang, &[]);
    let runs = [vllm.as_path(), sglang.as_path()];

    let table = compare(&runs, &[]);
    assert_eq!(row(&table, "backend")[1..], ["vllm", "sglang"]);
    assert_eq!(row(&table, "policy")[1..], ["source-first", "destination-first"]);
    assert_eq!(row(&table, "shape")[1..], ["2P+2D", "2P+2D"]);
    assert_eq!(row(&table, "trace")[1..], ["cascade.jsonl", "cascade.jsonl"]);
    assert_eq!(row(&table, "trace lines")[1..], ["240", "240"]);
    assert_eq!(row(&table, "prefill router")[1..], ["round-robin", "round-robin"]);
    assert!(row(&table, "goodput (requests/s)")[1..].iter().all(|c| *c == "—"), "no --slo: no goodput");
    for line in table.lines() {
        assert!(line.chars().count() <= 120, "wider than 120 columns: {line}");
    }

    let v = compare_json(&runs, &[]);
    let (a, b) = (&v["runs"][0], &v["runs"][1]);
    assert_eq!((a["backend"].as_str(), b["backend"].as_str()), (Some("vllm"), Some("sglang")));
    assert_eq!(v["baseline"], "cascade-vllm");
    let stranded = |r: &Value| num(&r["stranded_pin_block_seconds"]);
    assert!(stranded(a) > 0.0, "vLLM must strand prefill KV");
    assert!(stranded(a) > stranded(b), "vLLM {} vs SGLang {}", stranded(a), stranded(b));
    assert!(a["delta"].is_null(), "the baseline has no delta");
    let d = &b["delta"];
    assert!(num(&d["stranded_pin_block_seconds"]["absolute"]) < 0.0);
    assert!(num(&d["stranded_pin_block_seconds"]["percent"]) < 0.0);
    assert!(num(&d["peak_pinned_blocks"]["absolute"]) < 0.0);
    assert!(num(&d["max_source_pin_ms"]["absolute"]) < 0.0);
    assert!(a["cascade_started_at_ms"].is_number() && b["cascade_started_at_ms"].is_null());
    // Every delta is the difference of the two values, with its sign.
    for (k, dv) in d.as_object().unwrap() {
        if dv.is_null() {
            continue;
        }
        let diff = num(&b[k]) - num(&a[k]);
        let absolute = num(&dv["absolute"]);
        assert!((absolute - diff).abs() <= 1e-9 * diff.abs().max(1.0), "{k}: {absolute} vs {diff}");
        if let Some(p) = dv["percent"].as_f64() {
            assert_eq!(p.signum(), diff.signum() * num(&a[k]).signum(), "{k}");
        }
    }
    // The table shows the same numbers, and the delta's sign.
    let completed = row(&table, "completed");
    assert_eq!(completed[1..3], [a["completed_requests"].to_string(), b["completed_requests"].to_string()]);
    let delta_completed = num(&d["completed_requests"]["absolute"]);
    assert!(completed[3].starts_with(if delta_completed > 0.0 { '+' } else { '-' }), "{completed:?}");
    let stranded_row = row(&table, "stranded pin block-seconds");
    assert!(stranded_row[3].starts_with('-'), "{stranded_row:?}");
    assert_eq!(stranded_row[1].replace(',', ""), format!("{:.0}", stranded(a)));

    let csv = parse_csv(&compare(&runs, &["--csv"]));
    assert_eq!(csv.len(), 2);
    for (line, run) in csv.iter().zip([a, b]) {
        for k in ["name", "run_id", "backend", "shape", "config_digest"] {
            assert_eq!(line[k], run[k].as_str().unwrap(), "{k}");
        }
        for k in [
            "completed_requests",
            "failed_requests",
            "stranded_pin_block_seconds",
            "p99_ttft_ms",
            "preemptions",
        ] {
            assert_eq!(line[k].parse::<f64>().unwrap(), num(&run[k]), "{k}");
        }
    }
    assert_eq!(csv[0]["stranded_pin_block_seconds_delta"], "");
    assert_eq!(
        csv[1]["stranded_pin_block_seconds_delta"].parse::<f64>().unwrap(),
        num(&d["stranded_pin_block_seconds"]["absolute"])
    );
    // Deterministic: the same runs, the same bytes.
    assert_eq!(compare(&runs, &[]), table);
}

#[test]
fn goodput_is_throughput_under_a_loose_slo_zero_under_an_impossible_one_and_replay_agrees() {
    let t = tempfile::tempdir().unwrap();
    let run = t.path().join("mooncake");
    let loose = "ttft_ms=1e12,itl_ms=1e12,tpot_ms=1e12,e2e_ms=1e12";
    let report =
        replay("traces/mooncake-200.jsonl", &["--prefill", "2", "--decode", "2", "--slo", loose], &run);
    assert_eq!(report["completed_requests"], 200);
    assert_eq!(report["goodput_rps"], report["request_throughput_rps"]);
    assert_eq!(num(&report["goodput_fraction"]), 1.0);
    assert_eq!(num(&report["slo"]["ttft_ms"]), 1e12);

    let loose_run = &compare_json(&[&run], &["--slo", loose])["runs"][0];
    assert_eq!(loose_run["goodput_rps"], loose_run["request_throughput_rps"]);
    assert_eq!(loose_run["goodput_rps"], report["goodput_rps"], "compare folds what replay reported");
    let none = &compare_json(&[&run], &["--slo", "ttft_ms=0.000001"])["runs"][0];
    assert_eq!((num(&none["goodput_rps"]), num(&none["goodput_fraction"])), (0.0, 0.0));

    // A realistic objective splits the requests; replay and compare still agree to the bit.
    let slo = "ttft_ms=600,itl_ms=40";
    let graded = t.path().join("graded");
    let report = cascade("vllm", &graded, &["--slo", slo]);
    let folded = &compare_json(&[&graded], &["--slo", slo]);
    assert_eq!(folded["slo"], serde_json::json!({"ttft_ms": 600.0, "itl_ms": 40.0}));
    for k in ["goodput_rps", "goodput_fraction"] {
        assert_eq!(folded["runs"][0][k], report[k], "{k}");
    }
    let share = num(&report["goodput_fraction"]);
    assert!(share > 0.0 && share < 1.0, "{share}");
    let table = compare(&[&graded], &["--slo", slo]);
    assert_eq!(row(&table, "goodput (% of requests)")[1], format!("{:.1}%", share * 100.0));
    let o = cli()
        .arg("replay")
        .arg(fixture("traces/cascade.jsonl"))
        .args([
            "--config",
            fixture("configs/cascade.json").to_str().unwrap(),
            "--slo",
            slo,
            "--force",
            "--out",
        ])
        .arg(&graded)
        .output()
        .unwrap();
    let stdout = String::from_utf8(o.stdout).unwrap();
    let line = stdout.lines().find(|l| l.contains("goodput")).unwrap();
    assert!(line.contains(&format!("{:.1}% of requests (SLO {slo})", share * 100.0)), "{line}");
}

#[test]
fn the_run_id_follows_trace_config_and_seed() {
    let t = tempfile::tempdir().unwrap();
    let small = ["--prefill", "2", "--decode", "2"];
    let id = |name: &str, trace: &str, args: &[&str]| {
        let report = replay(trace, &[&small[..], args].concat(), &t.path().join(name));
        (
            report["run_id"].as_str().unwrap().to_string(),
            report["config_digest"].as_str().unwrap().to_string(),
        )
    };
    let (a, digest) = id("a", "traces/mooncake-200.jsonl", &["--seed", "1"]);
    let (again, digest_again) = id("again", "traces/mooncake-200.jsonl", &["--seed", "1"]);
    let (reseeded, digest_reseeded) = id("reseeded", "traces/mooncake-200.jsonl", &["--seed", "2"]);
    let (rerouted, digest_rerouted) =
        id("rerouted", "traces/mooncake-200.jsonl", &["--seed", "1", "--router", "kv"]);
    let (other_trace, _) = id("other-trace", "traces/cascade.jsonl", &["--seed", "1"]);
    assert_eq!(a, again, "identical inputs, identical run id");
    assert_eq!(digest, digest_again);
    assert_ne!(a, reseeded, "the seed is part of the run id");
    assert_eq!(digest, digest_reseeded, "the seed is not part of the config digest");
    assert_ne!(a, rerouted, "the configuration is part of the run id");
    assert_ne!(digest, digest_rerouted);
    assert_ne!(a, other_trace, "the trace is part of the run id");
    assert_eq!(digest.len(), 16);

    // The logs say the same: compare reads it back from the stream headers.
    let v = compare_json(&[&t.path().join("a"), &t.path().join("rerouted")], &[]);
    let (r0, r1) = (&v["runs"][0], &v["runs"][1]);
    assert_eq!(r0["run_id"], a.as_str());
    assert_eq!(r0["config_digest"], digest.as_str());
    assert_eq!(r0["seed"], 1);
    assert_eq!(r0["trace_lines"], 200);
    assert_eq!(
        (r0["prefill_router"].as_str(), r1["prefill_router"].as_str()),
        (Some("round-robin"), Some("kv"))
    );
    assert_eq!(r1["decode_router"], "kv");
    assert!(r0["trace"].as_str().unwrap().ends_with("mooncake-200.jsonl"));
}

#[test]
fn the_svg_has_a_cdf_line_per_run_and_a_strip_per_run() {
    let t = tempfile::tempdir().unwrap();
    let (vllm, sglang) = (t.path().join("vllm"), t.path().join("sglang"));
    cascade("vllm", &vllm, &[]);
    cascade("sglang", &sglang, &[]);
    let svg = t.path().join("compare.svg");
    let stdout = compare(&[&vllm, &sglang], &["--svg", svg.to_str().unwrap()]);
    assert!(stdout.contains(&format!("wrote {}", svg.display())));
    let text = std::fs::read_to_string(&svg).unwrap();
    let doc = roxmltree::Document::parse(&text).expect("well-formed SVG");
    let attr = |n: &roxmltree::Node, a: &str| n.attribute(a).unwrap_or("").to_string();
    for chart in ["ttft", "e2e"] {
        let lines: Vec<String> = doc
            .descendants()
            .filter(|n| n.has_tag_name("path") && attr(n, "class") == "cdf" && attr(n, "data-chart") == chart)
            .map(|n| attr(&n, "data-run"))
            .collect();
        assert_eq!(lines, ["vllm", "sglang"], "{chart}");
    }
    let strips: Vec<String> = doc
        .descendants()
        .filter(|n| n.has_tag_name("g") && attr(n, "class") == "strip")
        .map(|n| attr(&n, "data-run"))
        .collect();
    assert_eq!(strips, ["vllm", "sglang"]);
    // vLLM's strip is filled with pinned blocks; the drawing's scale is the larger peak.
    let vllm_strip =
        doc.descendants().find(|n| attr(n, "class") == "strip" && attr(n, "data-run") == "vllm").unwrap();
    assert!(vllm_strip.descendants().any(|n| attr(&n, "class") == "pinned"));
    assert!(attr(&vllm_strip, "data-blocks-top").parse::<u64>().unwrap() >= 1024);
}

#[test]
fn an_aggregated_run_has_no_stranding_figures() {
    let t = tempfile::tempdir().unwrap();
    let run = t.path().join("aggregated");
    replay("traces/mooncake-200.jsonl", &["--workers", "2"], &run);
    let v = &compare_json(&[&run], &[])["runs"][0];
    assert_eq!(v["shape"], "2 aggregated");
    assert_eq!(v["decode_router"], Value::Null);
    assert_eq!(v["stranded_pin_block_seconds"], Value::Null);
    assert_eq!(v["peak_pinned_blocks"], 0);
    let table = compare(&[&run], &[]);
    assert_eq!(row(&table, "stranded pin block-seconds")[1], "—");
    assert_eq!(row(&table, "prefill router")[1], "round-robin");
    assert_eq!(row(&table, "decode router")[1], "(none)");
}

#[test]
fn bad_input_exits_2_naming_it() {
    let t = tempfile::tempdir().unwrap();
    let missing = t.path().join("no-such-run");
    let o = cli().arg("compare").arg(&missing).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains(missing.to_str().unwrap()), "{o:?}");

    let run = t.path().join("run");
    replay("traces/mooncake-200.jsonl", &["--workers", "1"], &run);
    for (slo, needle) in [("ttft=100", "ttft"), ("itl_ms=soon", "itl_ms"), ("e2e_ms=0", "e2e_ms")] {
        let o = cli().arg("compare").arg(&run).args(["--slo", slo]).output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{slo}");
        assert!(String::from_utf8_lossy(&o.stderr).contains(needle), "{slo}: {o:?}");
        let o = cli()
            .arg("replay")
            .arg(fixture("traces/mooncake-200.jsonl"))
            .args(["--workers", "1", "--slo", slo, "--out"])
            .arg(t.path().join("never"))
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "replay {slo}");
        assert!(String::from_utf8_lossy(&o.stderr).contains(needle), "replay {slo}: {o:?}");
    }
    // An unwritable SVG names the file; nothing is half-printed.
    let bad_svg = t.path().join("no-such-dir").join("x.svg");
    let o = cli().arg("compare").arg(&run).arg("--svg").arg(&bad_svg).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains(bad_svg.to_str().unwrap()));
}

// ----- sweep -----

fn grids(specs: &[&str]) -> Vec<Grid> {
    specs.iter().map(|s| s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))).collect()
}

#[test]
fn grids_expand_in_order_the_last_fastest_with_labels_that_name_the_values() {
    let base = ReplayConfig { prefill_workers: 2, decode_workers: 2, ..ReplayConfig::default() };
    let runs =
        plan(&base, &grids(&["backend=vllm,sglang", "decode=1,2,3", "router=kv,round-robin"])).unwrap();
    let labels: Vec<&str> = runs.iter().map(|r| r.label.as_str()).collect();
    assert_eq!(labels.len(), 12);
    assert_eq!(
        labels[..4],
        [
            "000-backend=vllm,decode=1,router=kv",
            "001-backend=vllm,decode=1,router=round-robin",
            "002-backend=vllm,decode=2,router=kv",
            "003-backend=vllm,decode=2,router=round-robin",
        ]
    );
    assert_eq!(labels[11], "011-backend=sglang,decode=3,router=round-robin");
    for (i, r) in runs.iter().enumerate() {
        assert_eq!(r.index, i);
        let c = &r.config;
        assert_eq!(c.backend == Backend::Sglang, i >= 6);
        assert_eq!(c.decode_workers as usize, 1 + (i / 2) % 3);
        assert_eq!(c.prefill_workers, 2, "untouched keys keep the base's values");
        let router = if i % 2 == 0 { RouterMode::kv() } else { RouterMode::RoundRobin };
        assert_eq!((&c.prefill_router, &c.decode_router), (&router, &router), "router sets both stages");
    }

    // Dotted keys reach into tables; a per-role engine table starts from the shared one.
    let runs = plan(
        &base,
        &grids(&[
            "vllm.num_gpu_blocks=512",
            "decode_vllm.max_num_seqs=8",
            "transfer.bandwidth_gbps=12.5",
            "lease_renew_ms=null,1000",
        ]),
    )
    .unwrap();
    assert_eq!(runs.len(), 2);
    let c = &runs[1].config;
    assert_eq!(c.vllm.num_gpu_blocks, 512);
    let decode = c.decode_vllm.expect("decode_vllm set");
    assert_eq!((decode.max_num_seqs, decode.num_gpu_blocks), (8, 512));
    assert_eq!(decode.block_size, c.vllm.block_size);
    assert!(matches!(c.transfer, TransferConfig::Bandwidth(b) if b.bandwidth_gbps == 12.5));
    assert_eq!((runs[0].config.lease_renew_ms, c.lease_renew_ms), (None, Some(1000)));
    assert_eq!(runs[1].label, "001-vllm.num_gpu_blocks=512,decode_vllm.max_num_seqs=8,transfer.bandwidth_gbps=12.5,lease_renew_ms=1000");

    // As --workers: aggregated serving.
    let runs = plan(&base, &grids(&["workers=3", "speedup=2", "seed=4"])).unwrap();
    let c = &runs[0].config;
    assert_eq!((c.workers, c.prefill_workers, c.decode_workers), (3, 0, 0));
    assert_eq!((c.arrival_speedup, c.seed), (2.0, 4));

    // Names sort in run order however many runs there are, and stay filesystem-safe.
    let seeds: Vec<String> = (0..=1000).map(|s| s.to_string()).collect();
    let runs = plan(&base, &grids(&[&format!("seed={}", seeds.join(","))])).unwrap();
    assert_eq!((runs[0].label.as_str(), runs[1000].label.as_str()), ("0000-seed=0", "1000-seed=1000"));
    assert_eq!(label(7, 3, &[("x.y".into(), "a/b c:*".into())]), "007-x.y=a_b_c__");
}

#[test]
fn grids_and_shards_refuse_what_they_cannot_mean() {
    let base = ReplayConfig { prefill_workers: 2, decode_workers: 2, ..ReplayConfig::default() };
    let fails = |specs: &[&str], needles: &[&str]| {
        let e = plan(&base, &grids(specs)).expect_err(&format!("{specs:?}")).to_string();
        for n in needles {
            assert!(e.contains(n), "{specs:?}: `{e}` does not name `{n}`");
        }
    };
    fails(&["nonsense=1"], &["nonsense=1", "unknown field"]);
    fails(&["vllm.nonsense=1"], &["vllm.nonsense=1", "unknown field"]);
    fails(&["decode=abc"], &["decode=abc"]);
    fails(&["vllm.num_gpu_blocks=many"], &["vllm.num_gpu_blocks=many"]);
    fails(&["lease_ms.x=1"], &["lease_ms.x=1", "not a table"]);
    fails(&["router=fastest"], &["router=fastest", "fastest"]);
    fails(&["decode=1,2", "workers=2"], &["decode", "workers"]);
    fails(&["router=kv", "decode_router=p2c"], &["router", "decode_router"]);
    fails(&["seed=1", "seed=2"], &["seed", "twice"]);
    // Valid on its own, invalid as a configuration: the run is named.
    fails(&["decode=0,1"], &["000-decode=0", "disaggregated serving"]);
    for bad in ["decode", "decode=", "decode=1,,2", "=1", "decode=1,1"] {
        assert!(bad.parse::<Grid>().is_err(), "{bad}");
    }

    let shard: Shard = "2/3".parse().unwrap();
    let picked: Vec<usize> = (0..8).filter(|i| shard.includes(*i)).collect();
    assert_eq!(picked, [1, 4, 7]);
    for bad in ["3/2", "0/2", "1/0", "1", "a/b", "-1/2"] {
        assert!(bad.parse::<Shard>().unwrap_err().contains(bad), "{bad}");
    }
}

/// `sweep` on the cascade fixture with `args`; returns the process output.
fn sweep_cascade(out: &Path, args: &[&str]) -> std::process::Output {
    cli()
        .arg("sweep")
        .arg(fixture("traces/cascade.jsonl"))
        .arg("--config")
        .arg(fixture("configs/cascade.json"))
        .args(args)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap()
}

/// The cascade sweep of the tests: both backends, one and two decode workers.
fn sweep(out: &Path, args: &[&str]) -> std::process::Output {
    sweep_cascade(out, &[&["--grid", "backend=vllm,sglang", "--grid", "decode=1,2"], args].concat())
}

fn names_in_json(o: &std::process::Output) -> Vec<String> {
    assert!(o.status.success(), "sweep failed: {}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    v["runs"].as_array().unwrap().iter().map(|r| r["name"].as_str().unwrap().to_string()).collect()
}

/// The names in a directory, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Every file of a run directory, by name.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap()))
        .collect()
}

const CASCADE_RUNS: [&str; 4] = [
    "000-backend=vllm,decode=1",
    "001-backend=vllm,decode=2",
    "002-backend=sglang,decode=1",
    "003-backend=sglang,decode=2",
];

#[test]
fn a_sweep_writes_what_lone_replays_write_whatever_the_job_count() {
    let t = tempfile::tempdir().unwrap();
    let (serial, parallel) = (t.path().join("jobs-1"), t.path().join("jobs-2"));
    assert_eq!(names_in_json(&sweep(&serial, &["--jobs", "1", "--json"])), CASCADE_RUNS);
    assert_eq!(names_in_json(&sweep(&parallel, &["--jobs", "2", "--json"])), CASCADE_RUNS);
    assert_eq!(listing(&parallel), CASCADE_RUNS);
    for name in CASCADE_RUNS {
        // The flags a lone replay needs for the same run as the sweep's.
        let (backend, decode) = name.split_once("-backend=").unwrap().1.split_once(",decode=").unwrap();
        let alone = t.path().join(format!("alone-{name}"));
        let report = cascade(backend, &alone, &["--decode", decode]);
        let streams = |dir: &Path| {
            let mut f = files(dir);
            f.retain(|n, _| n.ends_with(".hlog"));
            f
        };
        let expected = streams(&alone);
        assert_eq!(expected.len(), 3 + decode.parse::<usize>().unwrap(), "{name}");
        for dir in [&serial, &parallel] {
            let run = dir.join(name);
            assert!(streams(&run) == expected, "{}: logs differ from the lone replay's", run.display());
            let swept: Value =
                serde_json::from_slice(&std::fs::read(run.join("report.json")).unwrap()).unwrap();
            for k in ["run_id", "completed_requests", "failed_requests", "mean_ttft_ms", "drained"] {
                assert_eq!(swept[k], report[k], "{name}: report.json {k}");
            }
        }
    }
    // The table is compare's, and `compare DIR/*` reads the runs back.
    let table = String::from_utf8(sweep(&t.path().join("table"), &[]).stdout).unwrap();
    assert_eq!(row(&table, "backend")[1..], ["vllm", "vllm", "sglang", "sglang"]);
    assert_eq!(row(&table, "shape")[1..], ["2P+1D", "2P+2D", "2P+1D", "2P+2D"]);
    assert!(table.lines().last().unwrap().starts_with("sweep: 4 runs in "), "{table}");
    let dirs: Vec<PathBuf> = CASCADE_RUNS.iter().map(|n| serial.join(n)).collect();
    let dirs: Vec<&Path> = dirs.iter().map(PathBuf::as_path).collect();
    let folded = compare_json(&dirs, &[]);
    assert_eq!(folded["runs"][3]["backend"], "sglang");

    // A second sweep into the same directory needs --force, and then replaces the runs.
    let again = sweep(&serial, &["--seed", "3"]);
    assert_eq!(again.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(stderr.contains("--force") && stderr.contains(CASCADE_RUNS[0]), "{stderr}");
    assert_eq!(names_in_json(&sweep(&serial, &["--seed", "3", "--force", "--json"])), CASCADE_RUNS);
    let reseeded: Value =
        serde_json::from_slice(&std::fs::read(serial.join(CASCADE_RUNS[0]).join("report.json")).unwrap())
            .unwrap();
    assert_eq!(reseeded["seed"], 3);
}

#[test]
fn shards_split_a_sweep_and_together_cover_every_run_once() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("sweep");
    let first = names_in_json(&sweep(&out, &["--shard", "1/2", "--json"]));
    let second = names_in_json(&sweep(&out, &["--shard", "2/2", "--json"]));
    assert_eq!(first, [CASCADE_RUNS[0], CASCADE_RUNS[2]]);
    assert_eq!(second, [CASCADE_RUNS[1], CASCADE_RUNS[3]]);
    assert_eq!(listing(&out), CASCADE_RUNS);
    // A shard run again is refused: its runs are there already.
    assert_eq!(sweep(&out, &["--shard", "2/2"]).status.code(), Some(2));
    // Another sweep's shard (here another seed) refuses the runs the first left too.
    let other = sweep(&out, &["--shard", "1/2", "--seed", "9"]);
    assert_eq!(other.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&other.stderr).contains("and 3 more"), "{other:?}");
}

#[test]
fn bad_sweep_input_exits_2_naming_it_and_a_run_that_does_not_drain_exits_1() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("never");
    for (args, needle) in [
        (&["--grid", "nonsense=1"][..], "nonsense"),
        (&["--grid", "decode=abc"], "decode=abc"),
        (&["--grid", "decode=1", "--shard", "3/2"], "3/2"),
        (&["--grid", "decode=1", "--jobs", "0"], "--jobs"),
    ] {
        let o = sweep_cascade(&out, args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert!(String::from_utf8_lossy(&o.stderr).contains(needle), "{args:?}: {o:?}");
    }
    assert!(!out.exists(), "nothing is written before every run is known to be valid");

    let o = cli()
        .arg("sweep")
        .arg(fixture("traces/livelock.jsonl"))
        .arg("--config")
        .arg(fixture("configs/livelock.json"))
        .args(["--prefill", "1", "--decode", "3", "--grid", "seed=1,2", "--out"])
        .arg(t.path().join("livelock"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let stderr = String::from_utf8_lossy(&o.stderr);
    for run in ["000-seed=1", "001-seed=2"] {
        assert!(stderr.contains(&format!("run {run} did not drain")), "{stderr}");
    }
    assert!(stderr.contains("livelocked"), "{stderr}");
}
