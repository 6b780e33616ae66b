//! Live mode end to end: real worker processes on loopback TCP, wall clocks at a small time
//! scale, and their logs checked against the replay of the same trace and configuration, and
//! after real faults (kill -9 of a worker or of the launcher, hostile connections).
//!
//! The tests here take turns (one live run at a time): a live run's timing is wall-clock
//! time, and several at once on a 2-core machine would only test the scheduler.

mod support;

use handoff_ledger::events::{verify_run, RunReader};
use handoff_ledger::ids::{ClockDomain, Role, WorkerId};
use handoff_ledger::projections::run::project_capacity;
use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use support::{cli, fixture};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_handoff-log"))
}

/// Starts `handoff-log live` (stdout to OUT.stdout, stderr to OUT.stderr).
fn start_live(trace: &str, args: &[&str], out: &Path, scale: &str) -> Child {
    let stdout = std::fs::File::create(out.with_extension("stdout")).unwrap();
    let stderr = std::fs::File::create(out.with_extension("stderr")).unwrap();
    Command::new(bin())
        .arg("live")
        .arg(fixture(trace))
        .args(args)
        .args(["--time-scale", scale, "--out"])
        .arg(out)
        .arg("--per-request")
        .arg(out.with_extension("requests.jsonl"))
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .unwrap()
}

fn stderr_of(out: &Path) -> String {
    std::fs::read_to_string(out.with_extension("stderr")).unwrap_or_default()
}

/// Waits for `child`, killing it (and failing) past `within`.
fn wait(child: &mut Child, within: Duration, what: &str) -> ExitStatus {
    let until = Instant::now() + within;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if Instant::now() > until {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not end within {} s", within.as_secs());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn replay(trace: &str, args: &[&str], out: &Path) {
    let o = cli().arg("replay").arg(fixture(trace)).args(args).arg("--out").arg(out).output().unwrap();
    assert!(o.status.success(), "replay failed: {}", String::from_utf8_lossy(&o.stderr));
}

/// `diff LIVE REPLAY`: its exit code and text.
fn diff(live: &Path, replay: &Path) -> (i32, String) {
    let o = cli().arg("diff").arg(live).arg(replay).output().unwrap();
    (o.status.code().unwrap_or(-1), String::from_utf8_lossy(&o.stdout).into_owned())
}

/// The workers the launcher wrote down once all had joined.
fn joined(out: &Path) -> Vec<Value> {
    let path = out.join("live-workers.json");
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(text) = std::fs::read_to_string(&path) {
            if let Ok(Value::Array(v)) = serde_json::from_str(&text) {
                return v;
            }
        }
        assert!(Instant::now() < until, "no {} after 30 s", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn member<'a>(workers: &'a [Value], name: &str) -> &'a Value {
    workers.iter().find(|w| w["worker"] == name).unwrap_or_else(|| panic!("{name} not in {workers:?}"))
}

/// One sample of a worker's `/metrics` (`None` when it does not answer).
fn scrape(address: &str) -> Option<String> {
    let mut s = TcpStream::connect(address).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    Some(body)
}

/// The value of the first sample line starting with `prefix`.
fn sample(text: &str, prefix: &str) -> Option<f64> {
    text.lines().find(|l| l.starts_with(prefix))?.rsplit(' ').next()?.parse().ok()
}

/// Polls `metrics` until `ready` holds for a scrape.
fn wait_for_metrics(metrics: &str, within: Duration, ready: impl Fn(&str) -> bool) {
    let until = Instant::now() + within;
    loop {
        if scrape(metrics).is_some_and(|t| ready(&t)) {
            return;
        }
        assert!(Instant::now() < until, "metrics at {metrics} never showed the state waited for");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn kill_9(pid: u64) {
    let ok = Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap().success();
    assert!(ok, "kill -9 {pid}");
}

fn pid_alive(pid: u64) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z "))
}

/// Every request of the per-request file has a terminal status.
fn every_request_ended(out: &Path, expected: usize) {
    let text = std::fs::read_to_string(out.with_extension("requests.jsonl")).unwrap();
    let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), expected, "one record per request");
    for l in &lines {
        let status = l["terminal_status"].as_str().unwrap_or("");
        assert!(["completed", "failed", "canceled", "rejected"].contains(&status), "no terminal status: {l}");
    }
}

/// Every stream verifies (the named ones may end in a torn tail), and every other engine
/// worker ends holding nothing.
fn survivors_hold_nothing(out: &Path, killed: &[&str]) {
    for entry in std::fs::read_dir(out).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|e| e == "hlog") {
            let name = p.file_stem().unwrap().to_string_lossy().into_owned();
            let summary = verify_run(&p);
            assert!(
                summary.is_ok() || killed.contains(&name.as_str()),
                "{}: {:?}",
                p.display(),
                summary.err()
            );
        }
    }
    let mut run = RunReader::open(out).unwrap().allow_missing_peers();
    for row in project_capacity(&mut run).unwrap() {
        if killed.contains(&row.worker.to_string().as_str()) {
            continue;
        }
        assert!(row.last.is_drained(), "{} still holds {}", row.worker, row.last);
    }
}

fn inspect(out: &Path) -> String {
    let o = cli().arg("inspect").arg(out).output().unwrap();
    String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
}

const SMALL: &[&str] = &["--prefill", "2", "--decode", "2"];

/// Where the launcher's frontend listens, as it says on stderr.
fn frontend_address(out: &Path) -> String {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let err = stderr_of(out);
        if let Some(rest) = err.split("frontend listening on ").nth(1) {
            return rest.split(';').next().unwrap().to_string();
        }
        assert!(Instant::now() < until, "the frontend never said where it listens: {err}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `handoff-log worker` started by hand (stderr to OUT.ROLE-INDEX.stderr).
fn start_worker(role: &str, index: &str, frontend: &str, listen: &str, out: &Path) -> Child {
    let stderr = std::fs::File::create(out.with_extension(format!("{role}-{index}.stderr"))).unwrap();
    Command::new(bin())
        .args(["worker", "--role", role, "--index", index, "--frontend", frontend, "--listen", listen])
        .arg("--out")
        .arg(out)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap()
}

/// The proposal's scenario 8: a live run and the replay of the same trace, configuration and
/// seed are equivalent (`diff` exits 0), for both backends, on both fixtures.
#[test]
fn live_runs_are_equivalent_to_their_replays() {
    let _turn = turn();
    let t = tempfile::tempdir().unwrap();
    // Routing that depends only on the order of arrivals and pins (round-robin, random):
    // load-based routers see wall-clock jitter in when bookings free (docs/live.md; vLLM's kv
    // was equivalent in 20 of 20 runs by hand, but in this suite one decode placement of 200
    // moved in 2 of about 50 runs, so it is not here). vLLM routes each decode when its
    // prefill pins, so the order of pins at the frontend decides placements: its runs take a
    // larger time scale, where a step's wall duration leaves the reports' hold a margin above
    // a loaded machine's scheduling jitter. SGLang routes both at arrival.
    let cascade = fixture("configs/cascade-short-lease.json").display().to_string();
    let mut runs: Vec<(String, &str, Vec<String>, &str)> = Vec::new();
    for (backend, scale, routers) in
        [("vllm", "0.1", &["round-robin"][..]), ("sglang", "0.02", &["round-robin", "random"])]
    {
        for router in routers {
            let args = [SMALL, &["--backend", backend, "--router", router]].concat();
            let args = args.iter().map(|a| a.to_string()).collect();
            runs.push((format!("mooncake-{backend}-{router}"), "traces/mooncake-200.jsonl", args, scale));
        }
        let args = ["--config", &cascade, "--backend", backend].map(String::from).to_vec();
        runs.push((format!("cascade-{backend}"), "traces/cascade.jsonl", args, scale));
    }
    let mut failures = Vec::new();
    for (name, trace, args, scale) in &runs {
        let live = t.path().join(format!("{name}-live"));
        let rep = t.path().join(format!("{name}-replay"));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut child = start_live(trace, &args, &live, scale);
        let status = wait(&mut child, Duration::from_secs(90), name);
        assert!(status.success(), "{name}: live exited {status}\n{}", stderr_of(&live));
        replay(trace, &args, &rep);
        let (code, text) = diff(&live, &rep);
        if code != 0 {
            failures.push(format!("{name}:\n{text}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} runs differ:\n{}",
        failures.len(),
        runs.len(),
        failures.join("\n")
    );
}

/// The cascade under short leases, live on `backend` at `scale` with metrics: its directory
/// (kept while the guard lives), the run directory, the launcher, and the joined workers.
fn start_cascade(backend: &str, scale: &str) -> (tempfile::TempDir, PathBuf, Child, Vec<Value>) {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("run");
    let config = fixture("configs/cascade-short-lease.json").display().to_string();
    let args = ["--config", &config, "--backend", backend, "--metrics"];
    let child = start_live("traces/cascade.jsonl", &args, &out, scale);
    let workers = joined(&out);
    (t, out, child, workers)
}

/// Where `name` serves its metrics.
fn metrics_of(workers: &[Value], name: &str) -> String {
    member(workers, name)["metrics"].as_str().unwrap().to_string()
}

/// kill -9 of `victim` (vLLM, cascade with short leases) once prefill-0's metrics say `ready`:
/// the run ends not drained, naming the lost worker; every request ends; no survivor holds a
/// block, slot or booking; inspect names the loss.
fn kill_and_check(victim: &str, ready: impl Fn(&str) -> bool) {
    let _turn = turn();
    let (_dir, out, mut child, workers) = start_cascade("vllm", "0.05");
    wait_for_metrics(&metrics_of(&workers, "prefill-0"), Duration::from_secs(30), ready);
    kill_9(member(&workers, victim)["pid"].as_u64().unwrap());
    let status = wait(&mut child, Duration::from_secs(90), &format!("live after kill -9 of {victim}"));
    let err = stderr_of(&out);
    assert_eq!(status.code(), Some(1), "a lost worker means the run did not drain\n{err}");
    assert!(err.contains(&format!("{victim} was lost")), "{err}");
    every_request_ended(&out, 240);
    survivors_hold_nothing(&out, &[victim]);
    let text = inspect(&out);
    assert!(
        text.contains(&format!("WORKER LOST: {victim}'s stream stops")),
        "inspect names the lost worker: {text}"
    );
}

/// kill -9 of a decode worker while sources are pinned for it, then a new process of it
/// started by hand: it takes over its stream (cutting the torn tail, recording what the dead
/// session held) under session 2 and takes new work; the run ends drained, every stream
/// verifies, and inspect tells the loss and the takeover.
#[test]
fn a_killed_worker_restarted_by_hand_takes_new_work_under_a_new_session() {
    let _turn = turn();
    // At 0.1 the trace's arrivals span 2.4 s of wall time: room for the restart to get work.
    let (_dir, out, mut child, workers) = start_cascade("vllm", "0.1");
    let address = frontend_address(&out);
    wait_for_metrics(&metrics_of(&workers, "prefill-0"), Duration::from_secs(30), |m| {
        sample(m, "handoff_kv_blocks{").is_some() && pinned(m) > 0.0
    });
    // A second process of a worker that is alive is refused, and says why: on this host its
    // stream is locked; from another directory (another host) the frontend says no.
    let elsewhere = out.with_file_name("elsewhere");
    let mut duplicates =
        [&out, &elsewhere].map(|dir| start_worker("decode", "1", &address, "127.0.0.1:0", dir));
    kill_9(member(&workers, "decode-0")["pid"].as_u64().unwrap());
    // Started at once: until the frontend finds the old session dead, it answers "not yet".
    let mut restarted = start_worker("decode", "0", &address, "127.0.0.1:0", &out);
    let reasons = [
        (&out, "held by another process of this worker"),
        (&elsewhere, "decode-1: its session is still in the run"),
    ];
    for (d, (dir, why)) in duplicates.iter_mut().zip(reasons) {
        assert!(!wait(d, Duration::from_secs(20), "a duplicate worker").success());
        let err = std::fs::read_to_string(dir.with_extension("decode-1.stderr")).unwrap_or_default();
        assert!(err.contains(why), "{err}");
    }
    let status = wait(&mut child, Duration::from_secs(90), "live after a restart");
    let err = stderr_of(&out);
    let worker_err = std::fs::read_to_string(out.with_extension("decode-0.stderr")).unwrap_or_default();
    assert!(status.success(), "the restarted worker drained, so the run did: {status}\n{err}\n{worker_err}");
    assert!(wait(&mut restarted, Duration::from_secs(20), "the restarted worker").success(), "{worker_err}");
    assert!(err.contains("rejoined as session 2"), "{err}");
    let report = std::fs::read_to_string(out.with_extension("stdout")).unwrap();
    assert!(report.contains("decode-0 was lost (") && report.contains("session 2 took over"), "{report}");
    every_request_ended(&out, 240);
    survivors_hold_nothing(&out, &[]);
    let mut stream = handoff_ledger::events::StreamReader::open(out.join("decode-0.hlog")).unwrap();
    let (mut lost, mut session, mut new_work) = (None, 1, 0);
    while let Some(rec) = stream.next_record().unwrap() {
        match rec.fact {
            handoff_ledger::events::Fact::SessionLost { generation, .. } => lost = Some(generation.0),
            handoff_ledger::events::Fact::SessionStarted { generation } => session = generation.0,
            handoff_ledger::events::Fact::DestinationActivated { .. } if session == 2 => new_work += 1,
            _ => {}
        }
    }
    assert_eq!((lost, session), (Some(1), 2), "the stream records the lost session, then the new one");
    assert!(new_work > 0, "the new session took handoffs");
    let text = inspect(&out);
    assert!(text.contains("WORKER LOST AND RESTARTED: decode-0's session 1 stops"), "{text}");
}

/// kill -9 of a decode worker while sources are pinned for it.
#[test]
fn killing_a_decode_worker_strands_nothing() {
    kill_and_check("decode-0", |m| sample(m, "handoff_kv_blocks{").is_some() && pinned(m) > 0.0);
}

/// kill -9 of a prefill worker while it holds pinned sources whose destinations wait for room on
/// decode.
#[test]
fn killing_a_prefill_worker_strands_nothing() {
    kill_and_check("prefill-0", |m| pinned(m) > 64.0);
}

/// The pinned-source blocks a scrape shows.
fn pinned(metrics: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with("handoff_kv_blocks{") && l.contains("class=\"pinned_source\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// kill -9 of the launcher: every worker sees its frontend link end, cancels what it holds,
/// closes its stream with its end marker, and exits.
#[test]
fn killing_the_launcher_leaves_no_worker_behind() {
    let _turn = turn();
    let (_dir, out, mut child, workers) = start_cascade("sglang", "0.05");
    wait_for_metrics(&metrics_of(&workers, "decode-0"), Duration::from_secs(30), |m| {
        sample(m, "handoff_num_requests_running{").unwrap_or(0.0) > 0.0
    });
    kill_9(u64::from(child.id()));
    let _ = child.wait();
    let pids: Vec<u64> = workers.iter().map(|w| w["pid"].as_u64().unwrap()).collect();
    let until = Instant::now() + Duration::from_secs(20);
    while pids.iter().any(|p| pid_alive(*p)) {
        assert!(Instant::now() < until, "workers still running 20 s after the launcher died: {pids:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Every worker closed its stream cleanly; the router's ends where the launcher died.
    for w in &workers {
        let name = w["worker"].as_str().unwrap();
        let path = out.join(format!("{name}.hlog"));
        let s = verify_run(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(s.unended.is_empty(), "{name} did not close its stream: {:?}", s.unended);
    }
    let mut run = RunReader::open(&out).unwrap().allow_missing_peers();
    for row in project_capacity(&mut run).unwrap() {
        if row.worker.role != Role::Router {
            assert!(row.last.is_drained(), "{} still holds {}", row.worker, row.last);
        }
    }
    let _ = WorkerId::ROUTER;
}

/// A connection that sends garbage to a worker's peer port, one that sends an oversized frame,
/// and one that says nothing are refused by name; the run goes on and matches its replay.
#[test]
fn hostile_connections_are_refused_and_the_run_goes_on() {
    let _turn = turn();
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("run");
    let args = ["--prefill", "2", "--decode", "2", "--backend", "sglang"];
    let mut child = start_live("traces/mooncake-200.jsonl", &args, &out, "0.03");
    let workers = joined(&out);
    let listen = member(&workers, "decode-1")["listen"].as_str().unwrap().to_string();
    let mut garbage = TcpStream::connect(&listen).unwrap();
    garbage.write_all(&[0, 0, 0, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9]).unwrap();
    let mut huge = TcpStream::connect(&listen).unwrap();
    huge.write_all(&u32::MAX.to_be_bytes()).unwrap();
    let _silent = TcpStream::connect(&listen).unwrap();
    let status = wait(&mut child, Duration::from_secs(60), "live with hostile connections");
    let err = stderr_of(&out);
    assert!(status.success(), "live exited {status}\n{err}");
    assert!(err.contains("refused a connection"), "the refusals are logged: {err}");
    let rep = t.path().join("replay");
    replay("traces/mooncake-200.jsonl", &args, &rep);
    let (code, text) = diff(&out, &rep);
    assert_eq!(code, 0, "{text}");
}

/// Whether `ss -K` can destroy a socket here (iproute2 and a kernel with sock_destroy).
fn ss_kill_works() -> bool {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut client = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let _server = listener.accept().unwrap();
    let killed = Command::new("ss")
        .args(["-K", "dst", "127.0.0.1", "dport", "=", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    client.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let mut buf = [0u8; 1];
    killed && (client.write_all(b"x").is_err() || client.read(&mut buf).is_err())
}

/// One TCP connection closed mid-transfer (the kernel destroys the sockets between a prefill and
/// the decode worker receiving from it): both sides end what they shared (peer lost), the
/// requests fail, the links reopen for later handoffs, and nothing is left held anywhere.
#[test]
fn closing_a_connection_mid_transfer_ends_both_sides() {
    if !ss_kill_works() {
        eprintln!(
            "closing_a_connection_mid_transfer_ends_both_sides: `ss -K` cannot destroy sockets here; not run"
        );
        return;
    }
    let _turn = turn();
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("run");
    // Transfers of 2 s (model) each, so one is surely moving when the connection goes.
    let config = t.path().join("slow-transfer.json");
    let slow = r#"{"prefill_workers": 2, "decode_workers": 2, "transfer": {"mode": "fixed", "delay_ns": 2000000000}}"#;
    std::fs::write(&config, slow).unwrap();
    let config = config.display().to_string();
    let args = ["--config", config.as_str(), "--backend", "vllm", "--metrics"];
    let mut child = start_live("traces/mooncake-200.jsonl", &args, &out, "0.03");
    let workers = joined(&out);
    let decode = member(&workers, "decode-0");
    let metrics = decode["metrics"].as_str().unwrap().to_string();
    wait_for_metrics(&metrics, Duration::from_secs(30), |m| {
        m.lines().any(|l| {
            l.contains("role=\"destination\"") && l.contains("state=\"receiving\"") && !l.ends_with(" 0")
        })
    });
    // Every connection into decode-0's peer port: the prefills' links to it.
    let port = decode["listen"].as_str().unwrap().rsplit(':').next().unwrap().to_string();
    let ok =
        Command::new("ss").args(["-K", "dst", "127.0.0.1", "dport", "=", &port]).status().unwrap().success();
    assert!(ok, "ss -K");
    let status = wait(&mut child, Duration::from_secs(60), "live after a connection was closed");
    let err = stderr_of(&out);
    assert!(status.success(), "every worker is alive and drains: {status}\n{err}");
    assert!(err.contains("peer link ended"), "{err}");
    every_request_ended(&out, 200);
    let text = std::fs::read_to_string(out.with_extension("requests.jsonl")).unwrap();
    assert!(text.contains("\"terminal_status\":\"failed\""), "the handoffs cut off failed");
    assert!(text.contains("\"terminal_status\":\"completed\""), "later handoffs went through on new links");
    survivors_hold_nothing(&out, &[]);
    let mut run = RunReader::open(&out).unwrap();
    let mut peer_lost = 0;
    while let Some((_, rec)) = run.next_record().unwrap() {
        if let handoff_ledger::events::Fact::HandoffCanceled { reason, .. } = rec.fact {
            peer_lost += u32::from(reason == handoff_ledger::ids::CancelReason::PeerLost);
        }
    }
    assert!(peer_lost >= 2, "both sides of a cut handoff end it themselves: {peer_lost}");
}

/// The frontend alone (`--external-workers`), and workers started by hand listening on every
/// interface, as on two hosts: the run goes as a launched one does and matches its replay.
#[test]
fn workers_started_by_hand_join_a_frontend_started_alone() {
    let _turn = turn();
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("run");
    let args = [
        "--prefill",
        "1",
        "--decode",
        "1",
        "--backend",
        "sglang",
        "--listen",
        "127.0.0.1:0",
        "--external-workers",
    ];
    let mut child = start_live("traces/mooncake-200.jsonl", &args, &out, "0.02");
    let address = frontend_address(&out);
    let mut workers: Vec<Child> = [("prefill", "0"), ("decode", "0")]
        .iter()
        .map(|(role, index)| start_worker(role, index, &address, "0.0.0.0:0", &out))
        .collect();
    let status = wait(&mut child, Duration::from_secs(60), "live with external workers");
    for w in &mut workers {
        assert!(wait(w, Duration::from_secs(20), "a worker started by hand").success());
    }
    assert!(status.success(), "live exited {status}\n{}", stderr_of(&out));
    let rep = t.path().join("replay");
    replay("traces/mooncake-200.jsonl", &args[..6], &rep);
    let (code, text) = diff(&out, &rep);
    assert_eq!(code, 0, "{text}");
    clocks_agree_on_one_host(&out);
}

/// Every stream's header says how its clock was set. On one host all processes read one system
/// clock, so each worker's estimated offset from the frontend's is within its probe's half
/// round trip (plus a little for the moments between reading the two clocks), and every model origin lies
/// within that of the frontend's.
fn clocks_agree_on_one_host(out: &Path) {
    let run = RunReader::open(out).unwrap();
    let sync = |h: &handoff_ledger::events::StreamHeader| match h.clock {
        ClockDomain::WallSynced(c) => c,
        other => panic!("{}: clock {other:?}, not synced", h.worker),
    };
    let router = run.headers().iter().find(|h| h.worker == WorkerId::ROUTER).map(sync).unwrap();
    assert_eq!((router.offset_ns, router.uncertainty_ns), (0, 0), "the frontend is the reference");
    for h in run.headers().iter().filter(|h| h.worker != WorkerId::ROUTER) {
        let c = sync(h);
        let bound = c.uncertainty_ns as i64 + 2_000_000;
        assert!(c.offset_ns.abs() <= bound, "{}: offset {} ns beyond ±{bound}", h.worker, c.offset_ns);
        let origins = (c.origin_unix_ns - router.origin_unix_ns).abs();
        assert!(origins <= bound, "{}: model origin {origins} ns from the frontend's", h.worker);
    }
}
