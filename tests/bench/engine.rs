//! `make bench-engine`: the engine at 1,000 VMs (or `EITRI_BENCH_VMS`)
//! against no-op fakes.
//!
//! - step_p50_us / step_p99_us: `Engine::step` latency with every VM
//!   converged (1,000 level-triggered passes dispatched per step; the step
//!   waits for none of them). 500 steps, idle between steps.
//! - rss_mb: resident memory with 1,000 idle workers.
//! - converge_ms vs converge_ideal_ms: 1,000 creates through 4 create slots
//!   with a fake that takes 2 ms per call. A create makes 4 calls inside its
//!   slot (image, root disk, seed, boot) and its preflight outside, so the
//!   ideal is 1000 × 2 ms × 4 / 4 + one 2 ms preflight. converge_ratio =
//!   converge_ms / converge_ideal_ms (1.0 = the engine adds nothing).

use std::sync::Arc;
use std::time::{Duration, Instant};

use eitri_agent::deadline::Deadline;
use eitri_agent::model::Phase;
use eitri_agent::reconcile::{Engine, EngineConfig};
use eitri_agent::state::Store;
use eitri_agent::testkit::{Fakes, Op, desired, present, snapshot};

/// The VM count: `EITRI_BENCH_VMS`, else 1,000.
fn vms() -> usize {
    std::env::var("EITRI_BENCH_VMS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(1000)
}
const SLOTS: usize = 4;
const CALL: Duration = Duration::from_millis(2);
const CALLS_IN_SLOT: u32 = 4;
const STEPS: usize = 500;

fn config() -> EngineConfig {
    EngineConfig {
        agent_version: "1.0.0".into(),
        vm_timeout: Some(Duration::from_secs(600)),
        max_concurrent_creates: SLOTS,
        ..EngineConfig::default()
    }
}

fn rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(f64::NAN);
    kb / 1024.0
}

/// Resident memory by kind, in MB: (worker stacks, the main heap, every
/// other anonymous mapping: the threads' malloc arenas, mostly). A stack is
/// an anonymous mapping of the workers' stack size, give or take a page.
fn rss_by_kind(stack_bytes: u64) -> (f64, f64, f64) {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
    let (mut stacks, mut heap, mut other) = (0u64, 0u64, 0u64);
    let mut kind = 0;
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        if let Some((from, to)) = first.split_once('-')
            && let (Ok(from), Ok(to)) = (u64::from_str_radix(from, 16), u64::from_str_radix(to, 16))
        {
            let path = line.split_whitespace().nth(5);
            let size = to - from;
            kind = match path {
                Some("[heap]") => 1,
                Some(_) => 3,
                None if size.abs_diff(stack_bytes) <= 8192 => 0,
                None => 2,
            };
        } else if first == "Rss:" {
            let kb: u64 = words.next().and_then(|v| v.parse().ok()).unwrap_or(0);
            match kind {
                0 => stacks += kb,
                1 => heap += kb,
                2 => other += kb,
                _ => {}
            }
        }
    }
    let mb = |kb: u64| kb as f64 / 1024.0;
    (mb(stacks), mb(heap), mb(other))
}

fn engine(dir: &std::path::Path, fakes: &Arc<Fakes>) -> Result<Engine, Box<dyn std::error::Error>> {
    let store = Arc::new(Store::open(dir)?);
    Ok(Engine::new(store, fakes.seams(), config()))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The fake's 2 ms sleeps would otherwise run up to 50 us late (the
    // default timer slack), which is the fake's error, not the engine's.
    // Threads inherit it, so every worker's sleeps are accurate too.
    nix::sys::prctl::set_timerslack(1)?;
    let vms = vms();
    let names: Vec<String> = (0..vms).map(|n| format!("vm-{n:05}")).collect();
    let snap = snapshot(1, names.iter().map(|n| present(desired(n))).collect());
    let forever = || Deadline::after(Duration::from_secs(600));

    // Convergence with slow fakes.
    let dir = tempfile::tempdir()?;
    eitri_agent::testkit::remove_on_signal(dir.path());
    let fakes = Fakes::new();
    fakes.set_recording(false);
    fakes.set_delay(CALL);
    let slow = engine(dir.path(), &fakes)?;
    let start = Instant::now();
    slow.step(&snap);
    if !slow.wait_idle(forever()) {
        return Err("creates did not finish".into());
    }
    let converge = start.elapsed();
    let ready = slow
        .published()
        .vms
        .iter()
        .filter(|r| r.phase == Some(Phase::Ready))
        .count();
    if ready != vms {
        return Err(format!("only {ready} of {vms} VMs converged").into());
    }
    drop(slow);
    drop(dir);
    let ideal = CALL * CALLS_IN_SLOT * vms as u32 / SLOTS as u32 + CALL;
    // The same ideal from what the fake's calls really took (a 2 ms sleep
    // runs a little long): the physical limit of this run.
    let in_slot = [Op::Resolve, Op::PrepareRootDisk, Op::Seed, Op::Boot]
        .iter()
        .map(|op| fakes.busy_time(*op))
        .sum::<Duration>();
    let calibrated = in_slot / SLOTS as u32 + fakes.busy_time(Op::Preflight) / vms as u32;

    // Step latency and memory with instant fakes.
    let dir = tempfile::tempdir()?;
    eitri_agent::testkit::remove_on_signal(dir.path());
    let fakes = Fakes::new();
    fakes.set_recording(false);
    let fast = engine(dir.path(), &fakes)?;
    fast.step(&snap);
    fast.wait_idle(forever());
    let rss = rss_mb();
    let (stacks, heap, arenas) = rss_by_kind(EngineConfig::default().worker_stack_bytes as u64);
    let mut steps: Vec<Duration> = Vec::with_capacity(STEPS);
    for _ in 0..STEPS {
        let start = Instant::now();
        let report = fast.step(&snap);
        steps.push(start.elapsed());
        std::hint::black_box(report);
        fast.wait_idle(forever());
    }
    steps.sort();
    let pct = |p: f64| steps[((steps.len() as f64 - 1.0) * p).round() as usize].as_secs_f64() * 1e6;

    println!(
        "fake calls took {:.3} ms on average instead of 2; ideal from them: {:.0} ms, engine overhead {:.1}%",
        in_slot.as_secs_f64() * 1e3 / (vms as f64 * 4.0),
        calibrated.as_secs_f64() * 1e3,
        (converge.as_secs_f64() / calibrated.as_secs_f64() - 1.0) * 100.0
    );
    println!(
        "converge: {:.0} ms for {vms} creates, ideal {:.0} ms; step at {vms} converged VMs: p50 {:.0} us, p99 {:.0} us; rss {rss:.1} MB",
        converge.as_secs_f64() * 1e3,
        ideal.as_secs_f64() * 1e3,
        pct(0.5),
        pct(0.99)
    );
    println!(
        "rss by kind: worker stacks {stacks:.1} MB, main heap {heap:.1} MB, other anonymous (thread arenas) {arenas:.1} MB"
    );
    println!(
        "bench=engine vms={vms} step_p50_us={:.0} step_p99_us={:.0} rss_mb={rss:.1} converge_ms={:.0} converge_ideal_ms={:.0} converge_ratio={:.3} converge_calibrated_ratio={:.3}",
        pct(0.5),
        pct(0.99),
        converge.as_secs_f64() * 1e3,
        ideal.as_secs_f64() * 1e3,
        converge.as_secs_f64() / ideal.as_secs_f64(),
        converge.as_secs_f64() / calibrated.as_secs_f64()
    );
    Ok(())
}
