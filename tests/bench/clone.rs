//! `make bench-clone`: VMs made from one template, through the agent
//! binary run as an operator runs it (a desired file renamed into place,
//! then SIGHUP; the agent's report polled from outside), in a private
//! network namespace with guest networking on. Run as root.
//!
//! 1. A template: a VM booted from the image, then wanted suspended and
//!    marked a template.
//! 2. Beside it, in the same run, `EITRI_BENCH_COLD` (default 3) cold
//!    boots of the same guest from the same image, each timed from the
//!    desired file's rename to its row saying running and ready: the
//!    yardstick.
//! 3. `SINGLES` clones one at a time, each timed the same way, then
//!    tombstoned. With the real guest, each also until an ssh login to
//!    it passes strict host key checking against the key its row reports
//!    (the clone's own, not its template's).
//! 4. With the real guest, the last cold boot kept running as a
//!    neighbour: connected to every 20 ms (a closed port: its kernel answers) for 5 s idle, then
//!    through the burst (p50, p99, the slowest, and how many failed).
//! 5. A burst: `EITRI_BENCH_CLONES` clones (default 100) named in one
//!    desired file; the wall time until every row says running and ready,
//!    and what the clones' hypervisors hold of the host's memory then
//!    (their resident memory, summed over their processes, per clone).
//!
//! With the stand-in by default; with `EITRI_REAL_CH`, `EITRI_REAL_KERNEL`
//! and `EITRI_REAL_IMAGE` (`make e2e-real`'s parts) a real Debian guest,
//! its guest agent the static `eitri-guest` (`make static`), the burst
//! `EITRI_BENCH_CLONES` (default 20 then). The state dir is the temp
//! dir's filesystem, or `EITRI_BENCH_DIR` (e.g. a loop-mounted XFS, where
//! clones are reflinked). `EITRI_BENCH_AGENT_ARGS` adds flags to the
//! agent's (say, `--max-concurrent-creates 1`); `EITRI_BENCH_LOG` names
//! a file to keep the agent's log in (and, beside it with the extension
//! `serial`, the first lone clone's console). `EITRI_BENCH_HUGEPAGES=yes`
//! backs the guests with 2 MiB huge pages (`--guest-hugepages yes`): the
//! bench sets aside as many as the template, the neighbour, a lone clone
//! and the burst need, touches each once, and gives them back at its end
//! (see [`HugePages`]). The last line: `bench=clone guest=…
//! memory=shared|hugepages shmem_thp page_reporting_order
//! cold_boot_ms_p50 clone_ready_ms_p50 clone_ready_ms_p90 cold_over_clone
//! clone_ssh_ms_p50 burst=N burst_wall_ms clone_rss_mb …`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[path = "agent.rs"]
mod agent;
#[path = "daemon.rs"]
mod daemon;
#[path = "figures.rs"]
mod figures;
use figures::{ms, percentile};

type Error = Box<dyn std::error::Error>;

const STANDIN: &str = env!("CARGO_BIN_EXE_eitri-standin-hypervisor");
const TEMPLATE: &str = "tpl";
/// Cold boots, unless `EITRI_BENCH_COLD` says how many.
const COLD: usize = 3;
const SINGLES: usize = 10;
/// A bound to give up on, not a measurement (per 100 VMs).
const PATIENCE: Duration = Duration::from_secs(300);

/// The guest the bench makes VMs of.
struct Guest {
    hypervisor: PathBuf,
    kernel: PathBuf,
    image: Option<PathBuf>,
    cmdline: &'static str,
    /// The agent's flags for it (the real guest's agent to deliver).
    extra: Vec<String>,
    mem_mb: u64,
    what: &'static str,
    burst: usize,
    /// The real guest's login user, and a key for it (the clones'
    /// authorized key): ssh is tried against real guests only.
    login: Option<(&'static str, PathBuf)>,
}

fn guest(dir: &Path) -> Result<Guest, Error> {
    let real = |var: &str| std::env::var_os(var).map(PathBuf::from);
    let burst = |default: usize| {
        std::env::var("EITRI_BENCH_CLONES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(default)
    };
    if let (Some(hypervisor), Some(kernel), Some(image)) = (
        real("EITRI_REAL_CH"),
        real("EITRI_REAL_KERNEL"),
        real("EITRI_REAL_IMAGE"),
    ) {
        let agent = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("target/x86_64-unknown-linux-musl/release/eitri-guest");
        if !agent.is_file() {
            return Err(format!("no {}: make static builds it", agent.display()).into());
        }
        return Ok(Guest {
            hypervisor,
            kernel,
            image: Some(image),
            cmdline: "console=ttyS0 root=/dev/vda rw",
            // Its boot is ready once its guest agent says so, asked at
            // each pass: a tick a second, not the daemon's hour.
            extra: vec![
                "--guest-agent".into(),
                agent.display().to_string(),
                "--tick".into(),
                "1s".into(),
            ],
            mem_mb: 512,
            what: "real",
            burst: burst(20),
            login: Some(("debian", client_key(dir)?)),
        });
    }
    let hypervisor = dir.join("hv");
    eitri_agent::testkit::standin_hypervisor(Path::new(STANDIN), &hypervisor, &[]);
    let kernel = dir.join("vmlinux");
    std::fs::write(&kernel, b"stand-in kernel")?;
    Ok(Guest {
        hypervisor,
        kernel,
        image: None,
        cmdline: "console=ttyS0",
        extra: Vec::new(),
        mem_mb: 64,
        what: "standin",
        burst: burst(100),
        login: None,
    })
}

/// A fresh ed25519 key for the bench's ssh logins: its private file.
fn client_key(dir: &Path) -> Result<PathBuf, Error> {
    let key = dir.join("client-key");
    let made = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", "bench", "-f"])
        .arg(&key)
        .status()?;
    if !made.success() {
        return Err("ssh-keygen failed".into());
    }
    Ok(key)
}

/// What is torn down at the end, whatever way the bench ends.
struct Cleanup {
    cgroup_root: String,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        eitri_agent::testkit::end_cgroup_root(&self.cgroup_root);
    }
}

struct Bench {
    daemon: daemon::Daemon,
    guest: Guest,
    template: serde_json::Value,
    /// The last cold boot, kept running beside the clones (real guest
    /// only): what a burst does to a running VM's latency is read off it.
    neighbour: Option<serde_json::Value>,
}

impl Bench {
    /// A VM of the guest's size from the image (`daemon.vm` sets the rest).
    fn vm(&self, name: &str) -> serde_json::Value {
        let mut vm = self.daemon.vm(name);
        vm["mem_mb"] = self.guest.mem_mb.into();
        vm["disk_gb"] = 2.into();
        vm
    }

    fn clone_of_template(&self, name: &str) -> serde_json::Value {
        let mut vm = self.vm(name);
        let entry = vm.as_object_mut().expect("an object");
        entry.remove("image_url");
        entry.remove("image_sha256");
        entry.insert("clone_of".into(), TEMPLATE.into());
        if let Some((_, key)) = &self.guest.login
            && let Ok(public) = std::fs::read_to_string(key.with_extension("pub"))
        {
            entry.insert("ssh_authorized_key".into(), public.trim().into());
        }
        vm
    }

    /// Logs in to `id` over ssh, its host key checked strictly against
    /// the one its row reports, until that passes (at most `patience`).
    fn strict_ssh(&self, id: &str, patience: Duration) -> Result<(), Error> {
        let Some((user, key)) = &self.guest.login else {
            return Ok(());
        };
        let row = self.row(id)?;
        let (ip, host_key) = (
            row["ip"].as_str().unwrap_or_default(),
            row["ssh_host_pubkey"].as_str().unwrap_or_default(),
        );
        let known = self.daemon.state().with_file_name(format!("known-{id}"));
        std::fs::write(&known, format!("{id} {host_key}\n"))?;
        let deadline = Instant::now() + patience;
        loop {
            let out = std::process::Command::new("ssh")
                .args(["-F", "/dev/null", "-i"])
                .arg(key)
                .args(["-o", "BatchMode=yes", "-o", "ConnectTimeout=2"])
                .arg("-o")
                .arg(format!("UserKnownHostsFile={}", known.display()))
                .args(["-o", "StrictHostKeyChecking=yes", "-o"])
                .arg(format!("HostKeyAlias={id}"))
                .arg(format!("{user}@{ip}"))
                .arg("true")
                .stdin(std::process::Stdio::null())
                .output()?;
            if out.status.success() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{id}: no strict ssh login: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )
                .into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The template: booted from the image, then wanted suspended and
    /// marked a template.
    fn make_template(&mut self) -> Result<(), Error> {
        let booted = self.vm(TEMPLATE);
        self.daemon.desire(std::slice::from_ref(&booted))?;
        let ready = |id: &'static str| {
            move |rows: &[serde_json::Value]| {
                rows.iter().any(|r| {
                    r["vm_id"] == id && r["power_state"] == "running" && r["phase"] == "ready"
                })
            }
        };
        self.daemon
            .wait_rows("the template ready", PATIENCE, ready(TEMPLATE))?;
        let mut template = booted;
        template["power_state"] = "suspended".into();
        template["template"] = true.into();
        self.template = template;
        self.daemon.desire(std::slice::from_ref(&self.template))?;
        self.daemon
            .wait_rows("the template saved", PATIENCE, |rows| {
                rows.iter()
                    .any(|r| r["vm_id"] == TEMPLATE && r["power_state"] == "suspended")
            })?;
        Ok(())
    }

    /// `others` wanted beside the template; the time until each of
    /// `ready` says running and ready.
    fn until_ready(
        &self,
        others: &[serde_json::Value],
        ready: &[String],
        patience: Duration,
    ) -> Result<Duration, Error> {
        let mut vms = self.standing();
        vms.extend_from_slice(others);
        let started = Instant::now();
        self.daemon.desire(&vms)?;
        self.daemon
            .wait_rows("running and ready", patience, |rows| {
                ready.iter().all(|id| {
                    rows.iter().any(|r| {
                        r["vm_id"] == id.as_str()
                            && r["power_state"] == "running"
                            && r["phase"] == "ready"
                    })
                })
            })?;
        Ok(started.elapsed())
    }

    /// `ids` tombstoned, and gone from the host: rows and quarantined
    /// entries both, so that the next clone is timed on a host where no
    /// guest is shutting down beside it.
    ///
    /// A quarantined VM is destroyed by its first pass after its grace,
    /// and between ticks (an hour here) only news runs a VM's pass: a
    /// desired file rewritten the same wakes none. So each nudge is news,
    /// the tombstones left out and then named again in turn. Nudging with
    /// one unchanged file once left a clone quarantined until the bench
    /// gave up: its one pass had come a few ms before its grace ended.
    fn remove(&self, ids: &[String]) -> Result<(), Error> {
        let with_tombstones = || {
            let mut vms = self.standing();
            vms.extend(
                ids.iter()
                    .map(|id| serde_json::json!({"vm_id": id, "tombstoned": true})),
            );
            vms
        };
        self.daemon.desire(&with_tombstones())?;
        let named = std::cell::Cell::new(true);
        self.daemon.wait_gone(ids, PATIENCE, || {
            named.set(!named.get());
            if named.get() {
                self.daemon.desire(&with_tombstones())
            } else {
                self.daemon.desire(&self.standing())
            }
        })
    }

    /// `count` cold boots, each timed to ready; the last one kept running
    /// as the neighbour where the guest is real, the others removed.
    fn cold_boots(&mut self, count: usize) -> Result<Vec<Duration>, Error> {
        let mut cold = Vec::new();
        for i in 0..count {
            let id = format!("cold-{i}");
            cold.push(self.until_ready(&[self.vm(&id)], std::slice::from_ref(&id), PATIENCE)?);
            if i + 1 == count && self.guest.login.is_some() {
                self.neighbour = Some(self.vm(&id));
            } else {
                self.remove(&[id])?;
            }
        }
        Ok(cold)
    }

    /// What is always wanted: the template, and the neighbour once there.
    fn standing(&self) -> Vec<serde_json::Value> {
        let mut vms = vec![self.template.clone()];
        vms.extend(self.neighbour.clone());
        vms
    }

    /// The address of `id`, from its row.
    fn address(&self, id: &str) -> Result<std::net::Ipv4Addr, Error> {
        let row = self.row(id)?;
        let ip = row["ip"]
            .as_str()
            .ok_or_else(|| format!("{id}: no address in its row"))?;
        Ok(ip.parse()?)
    }

    /// `id`'s row in the report the agent last wrote.
    fn row(&self, id: &str) -> Result<serde_json::Value, Error> {
        let report: serde_json::Value =
            serde_json::from_slice(&std::fs::read(self.daemon.state().join("report.json"))?)?;
        report["report"]["vms"]
            .as_array()
            .and_then(|rows| rows.iter().find(|r| r["vm_id"] == id).cloned())
            .ok_or_else(|| format!("{id}: no row in the report").into())
    }

    /// The resident memory (MiB) of the hypervisors of `ids`, summed over
    /// each one's processes, from the report's pids and /proc.
    fn rss_mb(&self, ids: &[String]) -> Result<f64, Error> {
        let report: serde_json::Value =
            serde_json::from_slice(&std::fs::read(self.daemon.state().join("report.json"))?)?;
        let mut kib = 0u64;
        for id in ids {
            let Some(pid) = report["details"][id]["pid"].as_u64() else {
                return Err(format!("{id}: no pid in the report").into());
            };
            kib += tree_rss_kib(pid as u32);
        }
        Ok(kib as f64 / 1024.0)
    }
}

/// `SINGLES` clones one at a time: each one's time to ready, and to a
/// strict ssh login (its ready time with the stand-in, which has no sshd).
fn singles(bench: &Bench) -> Result<(Vec<Duration>, Vec<Duration>), Error> {
    let mut ready = Vec::new();
    let mut logins = Vec::new();
    for i in 0..SINGLES {
        let id = format!("one-{i}");
        let started = Instant::now();
        let took = bench.until_ready(
            &[bench.clone_of_template(&id)],
            std::slice::from_ref(&id),
            PATIENCE,
        )?;
        ready.push(took);
        bench.strict_ssh(&id, Duration::from_secs(30))?;
        logins.push(started.elapsed());
        // The first one's console kept beside the agent's log: what its
        // guest said once restored.
        if i == 0
            && let Some(keep) = std::env::var_os("EITRI_BENCH_LOG")
        {
            let serial = eitri_agent::state::Layout::new(&bench.daemon.state())
                .serial_log(&eitri_agent::model::Id::parse(&id)?);
            std::fs::copy(serial, PathBuf::from(keep).with_extension("serial"))?;
        }
        bench.remove(&[id])?;
    }
    Ok((ready, logins))
}

/// What a burst came to.
struct Burst {
    wall: Duration,
    /// The clones' hypervisors' resident memory, MiB in all.
    rss: f64,
    /// The neighbour's connects, idle and through the burst.
    idle: Connected,
    during: Connected,
    /// SYNs sent again through the burst.
    resent: u64,
}

/// `n` clones named in one desired file, until each is running and ready,
/// the neighbour (if any) connected to, idle, then throughout.
fn burst(bench: &Bench, n: usize, neighbour: Option<std::net::Ipv4Addr>) -> Result<Burst, Error> {
    let ids: Vec<String> = (0..n).map(|i| format!("burst-{i}")).collect();
    let clones: Vec<serde_json::Value> = ids.iter().map(|id| bench.clone_of_template(id)).collect();
    let patience = PATIENCE * u32::try_from(n.div_ceil(100)).unwrap_or(1);
    let idle = neighbour.map(|ip| {
        let probing = Connects::start(ip);
        std::thread::sleep(Duration::from_secs(5));
        probing.stop()
    });
    let probing = neighbour.map(Connects::start);
    let resent_before = syn_resent();
    let wall = bench.until_ready(&clones, &ids, patience)?;
    let during = probing.map(Connects::stop);
    // A slow connect is a SYN lost and sent again, or one waited on.
    let resent = syn_resent().saturating_sub(resent_before);
    Ok(Burst {
        wall,
        rss: bench.rss_mb(&ids)?,
        idle: idle.unwrap_or_default(),
        during: during.unwrap_or_default(),
        resent,
    })
}

/// TCP connects to a running VM, one every 20 ms, each timed, on a thread
/// of their own until stopped. Each is to a port nothing listens on
/// ([`CLOSED_PORT`]): the guest's kernel answers it (a reset) as it would
/// a listening port's handshake, so the time is the same trip through the
/// host, the VMM and the guest, and no process in the guest is started
/// for it. Connects to its sshd started one there each (a fork and an
/// exec), fifty a second, and the neighbour's VMM then took a whole core
/// of this 2-core host through the burst it was meant to watch.
struct Connects {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Connected>,
}

/// The port the neighbour is connected to: the discard port, which a
/// Debian cloud image leaves closed.
const CLOSED_PORT: u16 = 9;

/// What the connects came to: each one's time (to the guest's answer,
/// refused or taken), and how many failed (no answer in 2 s, or an error
/// that is no answer).
#[derive(Default)]
struct Connected {
    took: Vec<Duration>,
    failed: usize,
}

impl Connects {
    fn start(ip: std::net::Ipv4Addr) -> Connects {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut seen = Connected::default();
            let at = std::net::SocketAddr::from((ip, CLOSED_PORT));
            while !stopped.load(Ordering::Relaxed) {
                let started = Instant::now();
                match std::net::TcpStream::connect_timeout(&at, Duration::from_secs(2)) {
                    Ok(_) => seen.took.push(started.elapsed()),
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                        seen.took.push(started.elapsed());
                    }
                    Err(_) => seen.failed += 1,
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            seen
        });
        Connects { stop, thread }
    }

    fn stop(self) -> Connected {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// SYNs this network namespace has sent again (TcpExt TCPSynRetrans).
fn syn_resent() -> u64 {
    let text = std::fs::read_to_string("/proc/net/netstat").unwrap_or_default();
    let mut lines = text.lines().filter(|l| l.starts_with("TcpExt:"));
    let (Some(names), Some(values)) = (lines.next(), lines.next()) else {
        return 0;
    };
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(name, _)| *name == "TCPSynRetrans")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0)
}

/// The resident memory of `pid` and its descendants, in KiB, the huge
/// pages they map counted (resident memory leaves them out).
fn tree_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    let own = field("VmRSS:") + field("HugetlbPages:");
    let children: u64 = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| {
            c.split_whitespace()
                .filter_map(|p| p.parse::<u32>().ok())
                .collect::<Vec<_>>()
        })
        .map(tree_rss_kib)
        .sum();
    own + children
}

/// 2 MiB huge pages the bench set aside for its guests, given back when
/// dropped.
///
/// Each is touched once here, before any guest has it. A host that is
/// itself a VM may have handed its free memory back to its own
/// hypervisor (virtio-balloon's free page reporting, 2 MiB blocks at a
/// time on the host this was measured on), and a page first touched
/// after that costs that hypervisor's fault too: 0.9 s against 0.09 s to
/// fault 512 MiB of them in. The pool keeps the pages it holds, so the
/// guests then fill memory that is the host's own, as on a host that is
/// not a VM.
struct HugePages {
    before: u64,
}

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";
const HUGE_PAGE: usize = 2 << 20;

impl HugePages {
    /// `more` pages set aside beside the host's own, and each touched.
    fn set_aside(more: u64) -> Result<HugePages, Error> {
        let read =
            || -> Result<u64, Error> { Ok(std::fs::read_to_string(NR_HUGEPAGES)?.trim().parse()?) };
        let before = read()?;
        std::fs::write(NR_HUGEPAGES, (before + more).to_string())?;
        let pages = HugePages { before };
        let now = read()?;
        if now < before + more {
            return Err(format!(
                "{NR_HUGEPAGES}: {now} huge pages set aside, {} asked: the host has too little free memory",
                before + more
            )
            .into());
        }
        pages.touch(free_huge_pages()?)?;
        Ok(pages)
    }

    /// `count` of the pool's free pages touched once (mapped and written
    /// at once, then given back to the pool).
    fn touch(&self, count: u64) -> Result<(), Error> {
        let len = count as usize * HUGE_PAGE;
        use nix::libc;
        // SAFETY: a fresh anonymous mapping the kernel places, written
        // only inside its `len` bytes, and unmapped before return.
        unsafe {
            let at = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB,
                -1,
                0,
            );
            if at == libc::MAP_FAILED {
                return Err(format!(
                    "cannot map {count} huge pages: {}",
                    std::io::Error::last_os_error()
                )
                .into());
            }
            for page in 0..count as usize {
                at.cast::<u8>().add(page * HUGE_PAGE).write_volatile(1);
            }
            libc::munmap(at, len);
        }
        Ok(())
    }
}

/// How the guests' memory was backed, and the host settings that decide
/// what filling it costs: the result line's `memory=… shmem_thp=…
/// page_reporting_order=…`.
fn memory(huge: bool) -> String {
    format!(
        "memory={} shmem_thp={} page_reporting_order={}",
        if huge { "hugepages" } else { "shared" },
        host_setting("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        host_setting("/sys/module/page_reporting/parameters/page_reporting_order"),
    )
}

/// A host setting the figures depend on, as its file says it (the
/// bracketed choice where it lists them), or `none`: whether shared
/// memory may take huge pages, and the order of the free blocks a host
/// that is a VM hands back to its own hypervisor (README, Templates and
/// clones).
fn host_setting(path: &str) -> String {
    let Ok(text) = std::fs::read_to_string(path) else {
        return "none".into();
    };
    eitri_agent::provision::checklist::chosen(&text)
        .unwrap_or(text.trim())
        .to_owned()
}

/// The pool's free huge pages (`HugePages_Free` in /proc/meminfo).
fn free_huge_pages() -> Result<u64, Error> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")?;
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("HugePages_Free:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| "/proc/meminfo says no HugePages_Free".into())
}

impl Drop for HugePages {
    fn drop(&mut self) {
        let _ = std::fs::write(NR_HUGEPAGES, self.before.to_string());
    }
}

/// The agent's flags: the guest's, then those to try (say, another
/// `--max-concurrent-creates`: `EITRI_BENCH_AGENT_ARGS`, split at
/// spaces), then `--guest-hugepages yes` with the pages set aside for it
/// where `EITRI_BENCH_HUGEPAGES=yes`.
fn agent_flags(guest: &Guest) -> Result<(Vec<String>, Option<HugePages>), Error> {
    let mut flags = guest.extra.clone();
    let tried = std::env::var("EITRI_BENCH_AGENT_ARGS").unwrap_or_default();
    flags.extend(tried.split_whitespace().map(str::to_owned));
    if std::env::var("EITRI_BENCH_HUGEPAGES").is_ok_and(|v| v == "yes") {
        // The template, the neighbour, a lone clone and the burst, and
        // one VM to spare.
        let pages = HugePages::set_aside((guest.burst as u64 + 4) * guest.mem_mb / 2)?;
        flags.extend(["--guest-hugepages".into(), "yes".into()]);
        return Ok((flags, Some(pages)));
    }
    Ok((flags, None))
}

fn main() -> Result<(), Error> {
    eitri_agent::testkit::net::private_network();
    let root = std::env::var_os("EITRI_BENCH_DIR").map(PathBuf::from);
    let dir = match &root {
        Some(root) => tempfile::tempdir_in(root)?,
        None => tempfile::tempdir()?,
    };
    eitri_agent::testkit::remove_on_signal(dir.path());
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o711),
    )?;
    let tag = format!("{:04x}", std::process::id() & 0xffff);
    let cleanup = Cleanup {
        cgroup_root: format!("eitri-test-{}", std::process::id()),
    };
    let guest = guest(dir.path())?;
    let images = dir.path().join("images");
    std::fs::create_dir_all(&images)?;
    let (url, sha) = agent::image_or_base(guest.image.as_deref(), &images)?;
    let (extra, pages) = agent_flags(&guest)?;
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let daemon = daemon::Daemon::start(
        &dir.path().join("agent"),
        &daemon::Parts {
            hypervisor: &guest.hypervisor,
            kernel: &guest.kernel,
            image: (&url, &sha),
            images: &images,
            cgroup_root: &cleanup.cgroup_root,
            tap_prefix: &format!("ec{tag}"),
            bridge: &format!("ebc{tag}"),
            cmdline: guest.cmdline,
            extra: &extra,
            vmm_ids: daemon::vmm_ids(),
            binary: None,
        },
        PATIENCE,
    )?;
    let mut bench = Bench {
        daemon,
        guest,
        template: serde_json::Value::Null,
        neighbour: None,
    };
    bench.make_template()?;

    let cold_boots = std::env::var("EITRI_BENCH_COLD")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(COLD);
    let cold = bench.cold_boots(cold_boots)?;
    let neighbour = match &bench.neighbour {
        Some(vm) => Some(bench.address(vm["vm_id"].as_str().unwrap_or_default())?),
        None => None,
    };
    let (singles, logins) = singles(&bench)?;
    let n = bench.guest.burst;
    let Burst {
        wall: burst,
        rss,
        idle,
        during,
        resent,
    } = burst(&bench, n, neighbour)?;
    let log = bench.daemon.log();
    let copied_whole = log.matches("were copied whole").count();
    // The agent's log kept, to read where each clone's time went.
    if let Some(keep) = std::env::var_os("EITRI_BENCH_LOG") {
        std::fs::write(keep, &log)?;
    }

    let p = |v: &[Duration], q: f64| percentile(v.iter().copied().map(ms).collect(), q);
    let (cold_p50, clone_p50) = (p(&cold, 0.5), p(&singles, 0.5));
    let ssh_p50 = p(&logins, 0.5);
    println!(
        "bench=clone guest={} state_dir={} {} cold_boots={cold_boots} cold_boot_ms_p50={cold_p50:.1} clones_alone={SINGLES} clone_ready_ms_p50={clone_p50:.1} clone_ready_ms_p90={:.1} cold_over_clone={:.1} clone_ssh_ms_p50={ssh_p50:.1} burst={n} burst_wall_ms={:.1} clone_rss_mb={:.1} copied_whole={copied_whole} neighbour_connect_ms_p50_idle={:.2} neighbour_connect_ms_p99_idle={:.2} neighbour_connect_ms_p50_burst={:.2} neighbour_connect_ms_p99_burst={:.2} neighbour_connect_ms_max_burst={:.2} neighbour_connects_failed_burst={} syns_resent_burst={resent} neighbour_connects_over_500ms_burst={}",
        bench.guest.what,
        root.map_or_else(|| "tmp".to_owned(), |r| r.display().to_string()),
        memory(pages.is_some()),
        p(&singles, 0.9),
        cold_p50 / clone_p50.max(1.0),
        ms(burst),
        rss / n as f64,
        p(&idle.took, 0.5),
        p(&idle.took, 0.99),
        p(&during.took, 0.5),
        p(&during.took, 0.99),
        p(&during.took, 1.0),
        during.failed,
        during
            .took
            .iter()
            .filter(|t| **t > Duration::from_millis(500))
            .count(),
    );
    drop(bench);
    drop(cleanup);
    Ok(())
}
