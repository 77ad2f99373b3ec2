//! `make bench-usage`: what sampling every running VM's usage costs the
//! agent. The agent binary runs as an operator runs it, with
//! `--usage-interval 10s`, and `EITRI_BENCH_VMS` (1,000 unless set)
//! stand-in VMs are made running through its desired file (each a jailed
//! VMM with its tap on the host network, answering `vm.counters` as
//! cloud-hypervisor does). Once every VM's figures are rates, the agent's
//! `usage` thread's CPU time is read from outside, off the kernel's
//! account of that thread (`/proc/<pid>/task/<tid>/schedstat`, in ns),
//! over a window of six intervals, beside the whole agent's (`stat`).
//!
//! The last line: `bench=usage vms=… interval=10s window_s=… usage_cpu_ms=…
//! usage_core_share_pct=… (the goal: under 1) per_vm_sample_us=…
//! agent_core_share_pct=…`. `EITRI_BENCH_USAGE_INTERVAL=0s` runs the same
//! agent sampling nothing, for the whole agent's share without it.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[path = "agent.rs"]
mod agent;
#[path = "daemon.rs"]
mod daemon;

type Error = Box<dyn std::error::Error>;

const STANDIN: &str = env!("CARGO_BIN_EXE_eitri-standin-hypervisor");
/// The measurement: six rounds.
const WINDOW: Duration = Duration::from_secs(60);
/// A bound to give up on, not a measurement.
const PATIENCE: Duration = Duration::from_secs(900);

struct Cleanup {
    cgroup_root: String,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        eitri_agent::testkit::end_cgroup_root(&self.cgroup_root);
    }
}

/// The time a task has run on a CPU, in nanoseconds: the first field of
/// its `schedstat`, beside `stat`.
fn ran_ns(stat: &Path) -> Result<u64, Error> {
    let schedstat = stat.with_file_name("schedstat");
    let text = std::fs::read_to_string(&schedstat)?;
    Ok(text
        .split_whitespace()
        .next()
        .ok_or("an empty schedstat")?
        .parse()?)
}

/// User and system time of a `/proc` stat file's task, in clock ticks.
fn ticks(stat: &Path) -> Result<u64, Error> {
    let text = std::fs::read_to_string(stat)?;
    let after = &text[text.rfind(')').ok_or("a stat line without its command")? + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let field = |n: usize| -> Result<u64, Error> {
        Ok(fields
            .get(n - 3)
            .ok_or("a short stat line")?
            .parse::<u64>()?)
    };
    Ok(field(14)? + field(15)?)
}

/// The agent's thread called `name`: its stat file.
fn thread_stat(pid: u32, name: &str) -> Result<PathBuf, Error> {
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let task = task?.path();
        if std::fs::read_to_string(task.join("comm"))?.trim() == name {
            return Ok(task.join("stat"));
        }
    }
    Err(format!("the agent has no thread called {name}").into())
}

fn main() -> Result<(), Error> {
    eitri_agent::testkit::net::private_network();
    let vms: usize = std::env::var("EITRI_BENCH_VMS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1000);
    // EITRI_BENCH_USAGE_INTERVAL=0s: the same agent not sampling, for
    // its own cost beside.
    let interval = std::env::var("EITRI_BENCH_USAGE_INTERVAL").unwrap_or_else(|_| "10s".to_owned());
    let sampled = interval != "0" && interval != "0s";
    let dir = agent::bench_dir()?;
    let tag = format!("{:04x}", std::process::id() & 0xffff);
    let cleanup = Cleanup {
        cgroup_root: format!("eitri-test-{}", std::process::id()),
    };
    let hypervisor = dir.path().join("hv");
    eitri_agent::testkit::standin_hypervisor(Path::new(STANDIN), &hypervisor, &[]);
    let kernel = dir.path().join("vmlinux");
    std::fs::write(&kernel, b"stand-in kernel")?;
    let images = dir.path().join("images");
    std::fs::create_dir_all(&images)?;
    let (url, sha) = agent::base_image(&images)?;
    let daemon = daemon::Daemon::start(
        &dir.path().join("agent"),
        &daemon::Parts {
            hypervisor: &hypervisor,
            kernel: &kernel,
            image: (&url, &sha),
            images: &images,
            cgroup_root: &cleanup.cgroup_root,
            tap_prefix: &format!("eu{tag}"),
            bridge: &format!("ebu{tag}"),
            cmdline: "console=ttyS0",
            extra: &["--usage-interval", &interval, "--tick", "5s"],
            vmm_ids: daemon::vmm_ids(),
            binary: None,
        },
        PATIENCE,
    )?;
    let wanted: Vec<serde_json::Value> = (0..vms)
        .map(|i| {
            let mut vm = daemon.vm(&format!("u-{i}"));
            vm["mem_mb"] = 16.into();
            vm
        })
        .collect();
    let started = Instant::now();
    daemon.desire(&wanted)?;
    daemon.wait_rows("every VM running", PATIENCE, |rows| {
        rows.len() == vms && rows.iter().all(|r| r["power_state"] == "running")
    })?;
    eprintln!(
        "{vms} VMs running after {:.1} s; waiting for their rates",
        started.elapsed().as_secs_f64()
    );
    if sampled {
        wait_for_rates(&daemon, vms)?;
    }

    let pid = daemon.pid();
    let usage = if sampled {
        Some(thread_stat(pid, "usage")?)
    } else {
        None
    };
    let agent = PathBuf::from(format!("/proc/{pid}/stat"));
    let hz =
        nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)?.ok_or("no clock tick rate")? as f64;
    let ran = |usage: &Option<PathBuf>| usage.as_deref().map_or(Ok(0), ran_ns);
    let (usage_before, agent_before, at) = (ran(&usage)?, ticks(&agent)?, Instant::now());
    std::thread::sleep(WINDOW);
    let (usage_after, agent_after, over) = (ran(&usage)?, ticks(&agent)?, at.elapsed());

    let usage_cpu = (usage_after - usage_before) as f64 / 1e9;
    let agent_cpu = (agent_after - agent_before) as f64 / hz;
    let every = eitri_agent::config::parse_duration(&interval).ok_or("a bad interval")?;
    let rounds = over.as_secs_f64() / every.as_secs_f64().max(f64::MIN_POSITIVE);
    println!(
        "bench=usage vms={vms} interval={interval} window_s={:.1} usage_cpu_ms={:.0} usage_core_share_pct={:.3} per_vm_sample_us={:.1} agent_core_share_pct={:.3}",
        over.as_secs_f64(),
        usage_cpu * 1e3,
        100.0 * usage_cpu / over.as_secs_f64(),
        usage_cpu * 1e6 / (rounds * vms as f64),
        100.0 * agent_cpu / over.as_secs_f64(),
    );
    destroy(&daemon, wanted)
}

/// Waits until every VM's figures are rates: two rounds have read it.
fn wait_for_rates(daemon: &daemon::Daemon, vms: usize) -> Result<(), Error> {
    let report = daemon.state().join("report.json");
    let deadline = Instant::now() + PATIENCE;
    loop {
        let file: serde_json::Value = serde_json::from_slice(&std::fs::read(&report)?)?;
        let rated = file["details"].as_object().map_or(0, |d| {
            d.values()
                .filter(|v| v["usage"]["over_ms"].as_u64() > Some(0))
                .count()
        });
        if rated == vms {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("only {rated} of {vms} VMs have rates").into());
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Every VM tombstoned, and gone before the bench ends.
fn destroy(daemon: &daemon::Daemon, wanted: Vec<serde_json::Value>) -> Result<(), Error> {
    let tombstoned: Vec<serde_json::Value> = wanted
        .into_iter()
        .map(|mut vm| {
            vm["tombstoned"] = true.into();
            vm
        })
        .collect();
    daemon.desire(&tombstoned)?;
    let vms_dir = daemon.state().join("vms");
    let deadline = Instant::now() + PATIENCE;
    while std::fs::read_dir(&vms_dir)?.next().is_some() {
        if Instant::now() > deadline {
            return Err("the VMs were not destroyed in time".into());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}
