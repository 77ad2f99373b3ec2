//! `make bench-wake`: a client on another host connects to a port a
//! sleeping VM publishes, and the agent wakes the VM for it. Run as root.
//!
//! The agent binary runs as a daemon (in a private network namespace,
//! guest networking on, `--publish-ports`), over a desired file naming
//! `VMS` VMs, each publishing its own host port to the guest's `PORT`,
//! wanted suspended with `wake_on_traffic` and an idle time of 1 s. The
//! client is in a namespace of its own behind a veth (another host, as far
//! as the agent can tell). Each round, once every VM is asleep (its row
//! says so), the client connects to each VM's port in turn:
//! - `wake_connect_ms`: its `connect()`, from the call to the handshake
//!   done, to the sleeping VM;
//! - `syn_retransmits`: the segments its kernel sent again (TCP_INFO's
//!   total), over every wake connect: 0 when the first SYN was delivered;
//! - `running_connect_ms`: the same connect at once again, to the VM now
//!   running: the baseline;
//! - `never_slept_connect_ms` (a real guest only, which boots running
//!   first): the same connect to each guest before it ever slept, the
//!   floor a wake adds its resume to;
//! - `resume_ms`: the resume inside that wake, as the agent logs it
//!   (`resumed in N ms`), and `wake_ms` the agent's own account, from the
//!   first frame to the guest running;
//! - `guest_agent_ms`: from the restored guest running to its guest
//!   agent's answer to the reseed the agent sends after every resume, as
//!   the agent logs it (`its guest agent answered N ms after its guest
//!   ran`), over `guest_agents_answered` resumes (the stand-in's scripted
//!   guest agent answers; a real guest without one answers none).
//!
//! `EITRI_BENCH_FLAGS` adds flags of the agent's (e.g.
//! `--userfaultfd-device=`, to compare resumes that read the whole
//! snapshot first). `EITRI_BENCH_VMS` sets how many VMs sleep (default 5); each round
//! wakes at most 5 of them. Once they are all asleep the agent's own cost
//! is read from /proc: `agent_rss_mb`, `agent_threads`, `agent_fds`.
//!
//! The guest is the stand-in's (`STANDIN_GUEST_TCP`: it answers ARP and
//! a SYN on its tap), or, with `EITRI_REAL_CH`, `EITRI_REAL_KERNEL` and
//! `EITRI_REAL_IMAGE` naming a real cloud-hypervisor, a Linux kernel and
//! a root filesystem with sshd (`make e2e-real` builds them), a real
//! guest's sshd on port 22. The last line: `bench=wake …`.

use std::net::{Ipv4Addr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[path = "agent.rs"]
mod agent;
#[path = "daemon.rs"]
mod daemon;
#[path = "figures.rs"]
mod figures;
use figures::{ms, percentile};

const STANDIN: &str = env!("CARGO_BIN_EXE_eitri-standin-hypervisor");
/// VMs asleep, unless `EITRI_BENCH_VMS` says otherwise.
const VMS: usize = 5;
/// VMs woken in each round.
const WOKEN: usize = 5;
const ROUNDS: usize = 4;
/// Connects to each real guest before it first sleeps.
const NEVER_SLEPT_CONNECTS: usize = 4;
const FIRST_PORT: u16 = 30100;
/// A bound to give up on, not a measurement (per 100 VMs).
const PATIENCE: Duration = Duration::from_secs(120);

/// The agent's resident memory (MiB), threads and open fds, from /proc.
fn cost(pid: u32) -> Result<(f64, usize, usize), Error> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .ok_or("no VmRSS")?;
    let threads = std::fs::read_dir(format!("/proc/{pid}/task"))?.count();
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count();
    Ok((kib / 1024.0, threads, fds))
}
/// The host's address on the client's link.
const HOST: Ipv4Addr = eitri_agent::testkit::net::THIS_SIDE;

type Error = Box<dyn std::error::Error>;

/// What is torn down at the end, whatever way the bench ends.
struct Cleanup {
    netns: String,
    cgroup_root: String,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        eitri_agent::testkit::end_cgroup_root(&self.cgroup_root);
    }
}

/// The guest: the hypervisor, its kernel, a root image (`None`: a blank
/// one), the kernel's command line, and the port it answers on.
struct Guest {
    hypervisor: PathBuf,
    kernel: PathBuf,
    image: Option<PathBuf>,
    cmdline: &'static str,
    port: u16,
    what: &'static str,
}

fn guest(dir: &Path) -> Result<Guest, Error> {
    let real = |var: &str| std::env::var_os(var).map(PathBuf::from);
    if let (Some(hypervisor), Some(kernel), Some(image)) = (
        real("EITRI_REAL_CH"),
        real("EITRI_REAL_KERNEL"),
        real("EITRI_REAL_IMAGE"),
    ) {
        return Ok(Guest {
            hypervisor,
            kernel,
            image: Some(image),
            cmdline: "console=ttyS0 root=/dev/vda rw",
            port: 22,
            what: "real",
        });
    }
    let hypervisor = dir.join("hv");
    eitri_agent::testkit::standin_hypervisor(
        Path::new(STANDIN),
        &hypervisor,
        &[("STANDIN_GUEST_TCP", "1")],
    );
    let kernel = dir.join("vmlinux");
    std::fs::write(&kernel, b"stand-in kernel")?;
    Ok(Guest {
        hypervisor,
        kernel,
        image: None,
        cmdline: "console=ttyS0",
        port: 8080,
        what: "standin",
    })
}

/// One connect from the client's namespace to `port` of the host: how
/// long it took, and how many segments its kernel sent again.
fn connect(netns: &str, port: u16) -> Result<(Duration, u32), String> {
    eitri_agent::testkit::net::within(netns, || {
        let started = Instant::now();
        let stream = TcpStream::connect_timeout(&(HOST, port).into(), Duration::from_secs(10))
            .map_err(|e| format!("connect to {port}: {e}"))?;
        let took = started.elapsed();
        let again = eitri_agent::testkit::net::retransmits(&stream).map_err(|e| e.to_string())?;
        let _ = eitri_agent::testkit::net::reset_on_close(&stream);
        Ok((took, again))
    })
}

/// The figures the agent logged after `from` (a byte offset of its log):
/// each `marker N ms`.
fn logged(log: &str, from: usize, marker: &str) -> Vec<Duration> {
    log.get(from..)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (_, rest) = l.split_once(marker)?;
            let n: u64 = rest.split_whitespace().next()?.parse().ok()?;
            Some(Duration::from_millis(n))
        })
        .collect()
}

/// The `q` quantile of `v` in milliseconds, with its fraction (0 for none).
fn fine(v: &[Duration], q: f64) -> f64 {
    let mut ms: Vec<f64> = v.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    ms.sort_by(f64::total_cmp);
    match ms.len() {
        0 => 0.0,
        n => ms[((n - 1) as f64 * q).round() as usize],
    }
}

/// As [`logged`], for figures with a fraction (`marker 1.2 ms`).
fn logged_fine(log: &str, from: usize, marker: &str) -> Vec<Duration> {
    log.get(from..)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (_, rest) = l.split_once(marker)?;
            let n: f64 = rest.split_whitespace().next()?.parse().ok()?;
            Some(Duration::from_secs_f64(n / 1000.0))
        })
        .collect()
}

/// Waits until each of the `n` guests answers on `port` at its address
/// (from this, the host's, namespace).
fn wait_sshd(
    daemon: &daemon::Daemon,
    n: usize,
    port: u16,
    patience: Duration,
) -> Result<(), Error> {
    let deadline = Instant::now() + patience;
    let addresses = std::cell::RefCell::new(Vec::new());
    daemon.wait_rows("every guest's address", patience, |rows| {
        let mut found = addresses.borrow_mut();
        *found = rows
            .iter()
            .filter_map(|r| r["ip"].as_str()?.parse::<Ipv4Addr>().ok())
            .collect();
        found.len() == n
    })?;
    let addresses = addresses.into_inner();
    for ip in addresses {
        while TcpStream::connect_timeout(&(ip, port).into(), Duration::from_secs(1)).is_err() {
            if Instant::now() > deadline {
                return Err(format!("{ip}:{port} never answered").into());
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    }
    Ok(())
}

/// The `n` VMs' entries: each woken on traffic, asleep after 1 s idle,
/// its guest's port published on a host port of its own.
fn wake_vms(daemon: &daemon::Daemon, n: usize, guest: &Guest) -> Vec<serde_json::Value> {
    (0..n)
        .map(|i| {
            let mut vm = daemon.vm(&format!("wake-{i}"));
            vm["wake_on_traffic"] = true.into();
            vm["idle_suspend_after_s"] = 1.into();
            vm["published_ports"] = serde_json::json!([{
                "host_port": FIRST_PORT + i as u16, "guest_port": guest.port,
            }]);
            // The stand-in's guest holds no memory: a thousand of them are
            // admitted on a small host.
            vm["mem_mb"] = 16.into();
            if guest.image.is_some() {
                vm["disk_gb"] = 2.into();
                vm["mem_mb"] = 512.into();
            }
            vm
        })
        .collect()
}

/// A real guest first boots, running and never idle, to its sshd
/// answering (a guest suspended mid-boot would wake to a port nobody
/// listens on yet). Then the baseline no wake touched: the same connect
/// to each guest before it ever slept (the running connect after a wake
/// still meets pages the restore has not brought in), each timed.
fn boot_first(
    daemon: &daemon::Daemon,
    vms: &[serde_json::Value],
    guest: &Guest,
    netns: &str,
    patience: Duration,
) -> Result<Vec<Duration>, Error> {
    let booting: Vec<serde_json::Value> = vms
        .iter()
        .map(|vm| {
            let mut vm = vm.clone();
            vm["wake_on_traffic"] = false.into();
            vm["idle_suspend_after_s"] = 0.into();
            vm
        })
        .collect();
    daemon.desire(&booting)?;
    wait_sshd(daemon, vms.len(), guest.port, patience * 3)?;
    let mut never_slept = Vec::new();
    for _ in 0..NEVER_SLEPT_CONNECTS {
        for i in 0..vms.len().min(WOKEN) {
            never_slept.push(connect(netns, FIRST_PORT + i as u16)?.0);
        }
    }
    Ok(never_slept)
}

/// What the rounds of wakes measured.
struct Woken {
    /// Each first connect, which wakes its VM.
    wakes: Vec<Duration>,
    /// Each connect right after, to the VM it woke.
    running: Vec<Duration>,
    /// The first connects' SYNs sent again.
    retransmitted: u32,
}

/// [`ROUNDS`] rounds: once every VM is asleep, a connect to each of the
/// first [`WOKEN`], which wakes it, and one more to it awake. The agent's
/// log is kept where `EITRI_BENCH_LOG` says, rounds cut short or not.
fn wake_rounds(
    daemon: &daemon::Daemon,
    vms_n: usize,
    netns: &str,
    patience: Duration,
    all_asleep: &dyn Fn(&[serde_json::Value]) -> bool,
) -> Result<Woken, Error> {
    let mut woken = Woken {
        wakes: Vec::new(),
        running: Vec::new(),
        retransmitted: 0,
    };
    let log_from = daemon.log().len();
    let rounds = (|| -> Result<(), Error> {
        for round in 0..ROUNDS {
            daemon.wait_rows(
                &format!("round {round}: every VM asleep"),
                patience,
                all_asleep,
            )?;
            for i in 0..vms_n.min(WOKEN) {
                let port = FIRST_PORT + i as u16;
                let (took, again) = connect(netns, port)?;
                woken.wakes.push(took);
                woken.retransmitted += again;
                let (took, _) = connect(netns, port)?;
                woken.running.push(took);
            }
        }
        Ok(())
    })();
    // The last wake's resume is logged once its snapshot is discarded,
    // after its guest answered: given a moment to land.
    let until = Instant::now() + Duration::from_secs(5);
    while logged(&daemon.log(), log_from, ": resumed in ").len() < woken.wakes.len()
        && Instant::now() < until
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Some(keep) = std::env::var_os("EITRI_BENCH_LOG") {
        std::fs::write(keep, daemon.log())?;
    }
    rounds.map(|()| woken)
}

/// The agent's flags beside the harness's: its published ports, and
/// `EITRI_BENCH_FLAGS`, to compare settings in turns (e.g.
/// `--userfaultfd-device=`: resumes that read the whole snapshot first).
fn agent_flags() -> Vec<String> {
    ["--publish-ports", "30000-39999"]
        .into_iter()
        .map(str::to_owned)
        .chain(
            std::env::var("EITRI_BENCH_FLAGS")
                .unwrap_or_default()
                .split_whitespace()
                .map(str::to_owned),
        )
        .collect()
}

fn main() -> Result<(), Error> {
    eitri_agent::testkit::net::private_network();
    let dir = agent::bench_dir()?;
    let tag = format!("{:04x}", std::process::id() & 0xffff);
    let cleanup = Cleanup {
        netns: format!("etwk{tag}"),
        cgroup_root: format!("eitri-test-{}", std::process::id()),
    };
    let guest = guest(dir.path())?;
    let images = dir.path().join("images");
    std::fs::create_dir_all(&images)?;
    let (url, sha) = agent::image_or_base(guest.image.as_deref(), &images)?;
    let _remote = eitri_agent::testkit::net::remote_host(&cleanup.netns, "etwake");
    let extra = agent_flags();
    let daemon = daemon::Daemon::start(
        &dir.path().join("agent"),
        &daemon::Parts {
            hypervisor: &guest.hypervisor,
            kernel: &guest.kernel,
            image: (&url, &sha),
            images: &images,
            cgroup_root: &cleanup.cgroup_root,
            tap_prefix: &format!("ew{tag}"),
            bridge: &format!("ebw{tag}"),
            cmdline: guest.cmdline,
            extra: &extra.iter().map(String::as_str).collect::<Vec<_>>(),
            vmm_ids: daemon::vmm_ids(),
            binary: None,
        },
        PATIENCE,
    )?;
    let vms_n: usize = std::env::var("EITRI_BENCH_VMS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(VMS);
    let patience = PATIENCE * u32::try_from(vms_n.div_ceil(100)).unwrap_or(1);
    let vms = wake_vms(&daemon, vms_n, &guest);
    let never_slept = if guest.image.is_some() {
        boot_first(&daemon, &vms, &guest, &cleanup.netns, patience)?
    } else {
        Vec::new()
    };
    let vms: Vec<serde_json::Value> = vms
        .into_iter()
        .map(|mut vm| {
            vm["power_state"] = "suspended".into();
            vm
        })
        .collect();
    daemon.desire(&vms)?;
    let all_asleep = |rows: &[serde_json::Value]| {
        rows.len() == vms_n && rows.iter().all(|r| r["asleep"] == true)
    };
    daemon.wait_rows("every VM asleep", patience, all_asleep)?;
    let (rss_mb, threads, fds) = cost(daemon.pid())?;
    let log_from = daemon.log().len();
    let Woken {
        wakes,
        running,
        retransmitted,
    } = wake_rounds(&daemon, vms_n, &cleanup.netns, patience, &all_asleep)?;
    let log = daemon.log();
    let resumes = logged(&log, log_from, ": resumed in ");
    let agent_wakes = logged(&log, log_from, "its guest ran ");
    let guest_agents = logged_fine(&log, log_from, "its guest agent answered ");
    let p = |v: &[Duration], q: f64| percentile(v.iter().copied().map(ms).collect(), q);
    let (wake_p50, resume_p50) = (p(&wakes, 0.5), p(&resumes, 0.5));
    let never = if never_slept.is_empty() {
        String::new()
    } else {
        format!(" never_slept_connect_ms_p50={}", p(&never_slept, 0.5))
    };
    println!(
        "bench=wake guest={} vms={vms_n} agent_rss_mb={rss_mb:.1} agent_threads={threads} agent_fds={fds} rounds={ROUNDS} wakes={} wake_connect_ms_p50={} wake_connect_ms_p90={} syn_retransmits={retransmitted} resume_ms_p50={} resumes_logged={} wake_ms_p50={} running_connect_ms_p50={} wake_over_resume_ms={} guest_agent_ms_p50={:.2} guest_agent_ms_p90={:.2} guest_agents_answered={}{never}",
        guest.what,
        wakes.len(),
        wake_p50,
        p(&wakes, 0.9),
        resume_p50,
        resumes.len(),
        p(&agent_wakes, 0.5),
        p(&running, 0.5),
        wake_p50 - resume_p50,
        fine(&guest_agents, 0.5),
        fine(&guest_agents, 0.9),
        guest_agents.len(),
    );

    drop(daemon);
    drop(cleanup);
    Ok(())
}
