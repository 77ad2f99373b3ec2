//! The crash-consistency proof: the real agent (built with the
//! `crashpoints` feature) in standalone mode, driving the stand-in
//! hypervisor, killed with SIGKILL at every named crash point
//! (`eitri_agent::crash::POINTS`) and then at random moments of mixed
//! create, stop and destroy traffic; restarted after each kill, and checked
//! once it has converged:
//!
//! 1. every desired-running VM has exactly one live VMM;
//! 2. no VMM lives that no record or desired VM explains;
//! 3. no root disk was replaced under a live VMM (the stand-in logs the
//!    inode it started on);
//! 4. every record parses;
//! 5. no volume is lost;
//! 6. no temp file is left (checked after a clean stop);
//! 7. `report.json` always parses (polled throughout);
//! 8. the report matches the processes;
//! 9. every desired-suspended VM has no live VMM and a whole snapshot, and
//!    every desired-running one no snapshot: never both, never neither;
//! 10. no snapshot is restored twice (the stand-in writes a nonce into
//!     each snapshot and logs it at each restore);
//! 11. every VM wanted suspended with wake on traffic is asleep (no VMM,
//!     a whole snapshot) or awake (one VMM, no snapshot), or passing
//!     between the two for no longer than a suspend or a wake takes, while
//!     frames sent to it wake it (guest networking is on, in the test's own
//!     network namespace).
//! 12. a template's snapshot and disk are never written once it is one
//!     (their inodes, sizes and times are those it first converged with);
//! 13. every running clone's guest was given its own identity after its
//!     last restore (the stand-in logs the hostname it was given);
//! 14. every VM wanted running runs (its VMM does not say its guest is
//!     paused), a running template has a whole save, and a VM that is no
//!     longer one keeps no save of it.

// Linux only: it drives Linux-only parts (namespaces, taps, /proc, the
// cloud-hypervisor backend or its stand-in).
#![cfg(target_os = "linux")]

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use eitri_agent::daemon::XorShift;

const AGENT: &str = env!("CARGO_BIN_EXE_eitri-agent");
const STANDIN: &str = env!("CARGO_BIN_EXE_eitri-standin-hypervisor");
/// How long a restarted agent gets to converge before it is a violation.
const CONVERGE: Duration = Duration::from_secs(30);
/// How long a converged host must stay so to count: longer than the
/// agent's tick (200 ms), so a restarted agent that undoes what it found at
/// its first tick is caught.
const STEADY: Duration = Duration::from_millis(300);
/// How long a sleeper may be seen passing between asleep and awake (its
/// VMM alive beside a whole snapshot) before it counts as stuck there.
/// Every idle suspend passes through that state (its snapshot is committed
/// before its VMM stops), and so does every wake (the restored VMM runs
/// before its snapshot is discarded); each lasts tens of milliseconds.
const PASSING: Duration = Duration::from_secs(5);
/// How much of the agents' log a violation carries.
const LOG_LINES: usize = 60;

pub struct Summary {
    pub points: usize,
    pub point_runs: usize,
    pub random_kills: usize,
    pub violations: Vec<String>,
    pub converge_s: Vec<f64>,
    /// Random kills after which a VM's row said traffic had woken it
    /// (under that agent): the wakes the random phase reached.
    pub woken: usize,
    /// Sleepers seen passing between asleep and awake while a host was
    /// checked, and the longest such passing seen (see [`PASSING`]).
    pub passings: usize,
    pub passing_longest: Duration,
}

/// What a VM should be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Want {
    Running,
    Stopped,
    Suspended,
    /// Suspended with wake on traffic and an idle time of 1 s: asleep, or
    /// awake after a frame woke it.
    Sleeping,
    /// Tombstoned: destroyed at once (the tombstone grace is zero).
    Gone,
    /// The template clones are made from ([`TEMPLATE`]): suspended, and
    /// marked so.
    Template,
    /// Running, a clone of [`TEMPLATE`].
    Clone,
    /// Running, and marked a template: saved once ready, and never left
    /// paused by its save.
    LiveTemplate,
}

/// A file's path, inode, size, and modification and change times.
type FileStamp = (String, u64, u64, i64, i64);

/// The one template of the runs, whose clones are [`Want::Clone`].
const TEMPLATE: &str = "vm-t";

#[derive(Clone, Debug, Default, PartialEq)]
struct Desired {
    vms: BTreeMap<String, Want>,
    /// Volume id to size in GiB.
    volumes: BTreeMap<String, u64>,
}

impl Desired {
    fn json(&self, base_url: &str, base_sha: &str) -> String {
        let vms: Vec<String> = self
            .vms
            .iter()
            .map(|(id, want)| match want {
                Want::Gone => format!(r#"{{"vm_id":"{id}","tombstoned":true}}"#),
                Want::Clone => format!(
                    r#"{{"vm_id":"{id}","name":"{id}","clone_of":"{TEMPLATE}","vcpus":1,"mem_mb":64,"disk_gb":1,"power_state":"running"}}"#
                ),
                _ => format!(
                    r#"{{"vm_id":"{id}","name":"{id}","image_url":"{base_url}","image_sha256":"{base_sha}","vcpus":1,"mem_mb":64,"disk_gb":1,"power_state":"{}"{}}}"#,
                    match want {
                        Want::Running | Want::Clone | Want::LiveTemplate => "running",
                        Want::Suspended | Want::Sleeping | Want::Template => "suspended",
                        Want::Stopped | Want::Gone => "stopped",
                    },
                    match want {
                        Want::Sleeping => r#","wake_on_traffic":true,"idle_suspend_after_s":1"#,
                        Want::Template | Want::LiveTemplate => r#","template":true"#,
                        _ => "",
                    }
                ),
            })
            .collect();
        let volumes: Vec<String> = self
            .volumes
            .iter()
            .map(|(v, gb)| format!(r#"{{"volume_id":"{v}","size_gb":{gb}}}"#))
            .collect();
        format!(
            r#"{{"vms":[{}],"volumes":[{}]}}"#,
            vms.join(","),
            volumes.join(",")
        )
    }
}

struct Host {
    dir: tempfile::TempDir,
    base_url: String,
    base_sha: String,
    agent: Option<Child>,
    /// report.json reads that did not parse (invariant 7).
    torn_reports: usize,
    /// When the running agent was started, in Unix ms: a report written
    /// before it is the last agent's, and proves nothing about this one.
    started_ms: u64,
    /// Each volume's inode once it first converged: a volume made again
    /// is a volume lost (invariant 5).
    volume_inodes: BTreeMap<String, u64>,
    /// How long each sleeper seen passing between asleep and awake was
    /// seen so, once it had passed.
    passings: Vec<Duration>,
    /// The template's snapshot files and disk as first converged (their
    /// inode, size and times): never written after (invariant 12).
    template_stamp: Option<Vec<FileStamp>>,
}

impl Host {
    fn new() -> Host {
        let dir = tempfile::tempdir().expect("tempdir");
        eitri_agent::testkit::remove_on_signal(dir.path());
        std::fs::create_dir(dir.path().join("library")).expect("image root");
        let base = dir.path().join("library/base.raw");
        std::fs::write(&base, vec![0x5au8; 1 << 20]).expect("base");
        let base_sha = eitri_agent::image::sha256_file(&base).expect("hash");
        std::fs::write(dir.path().join("vmlinux"), b"k").expect("kernel");
        let hv = dir.path().join("hv");
        eitri_agent::testkit::standin_hypervisor(std::path::Path::new(STANDIN), &hv, &[]);
        Host {
            base_url: format!("file://{}", base.display()),
            base_sha,
            dir,
            agent: None,
            torn_reports: 0,
            started_ms: 0,
            volume_inodes: BTreeMap::new(),
            passings: Vec::new(),
            template_stamp: None,
        }
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    fn run_dir(&self) -> PathBuf {
        self.dir.path().join("run")
    }

    fn want(&self, d: &Desired) {
        let temp = self.dir.path().join(".desired.tmp");
        std::fs::write(&temp, d.json(&self.base_url, &self.base_sha)).expect("desired");
        std::fs::rename(temp, self.dir.path().join("desired.json")).expect("rename");
    }

    fn start(&mut self, crash_at: Option<&str>) {
        let confinement = eitri_agent::testkit::confinement(self.dir.path());
        let mut cmd = Command::new(AGENT);
        cmd.args(["run", "--state-dir"])
            .arg(self.state())
            .arg("--desired")
            .arg(self.dir.path().join("desired.json"))
            .arg("--hypervisor")
            .arg(self.dir.path().join("hv"))
            .arg("--kernel")
            .arg(self.dir.path().join("vmlinux"))
            .arg("--run-dir")
            .arg(self.run_dir())
            .arg("--image-root")
            .arg(self.dir.path().join("library"))
            .arg("--kvm-device")
            .arg(&confinement.kvm)
            .arg("--userfaultfd-device")
            .arg(confinement.userfaultfd.clone().unwrap_or_default())
            .arg("--cgroup-root")
            .arg(&confinement.cgroup_root)
            .arg("--agents-dir")
            .arg(self.dir.path().join("agents"))
            .args([
                "--underlay-bridge",
                &format!("ecb{:04x}", std::process::id() & 0xffff),
                "--tap-prefix",
                &format!("ec{:04x}", std::process::id() & 0xffff),
                "--tick",
                "200ms",
                "--tombstone-grace",
                "0",
                "--shutdown-grace",
                "5s",
            ])
            .env_clear()
            // ip and nft, for the guest networking.
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("EITRI_LOG", log_level())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(self.dir.path().join("agent.log"))
                    .expect("log"),
            );
        if let Some(point) = crash_at {
            cmd.env("EITRI_CRASH_AT", point);
        }
        self.started_ms = unix_ms();
        self.agent = Some(cmd.spawn().expect("agent"));
    }

    /// Waits (at most `bound`) until every VM `d` wants sleeping is asleep,
    /// as the report says.
    fn until_asleep(&self, d: &Desired, bound: Duration) {
        let until = Instant::now() + bound;
        while Instant::now() < until {
            let rows = self
                .report()
                .and_then(|r| r["report"]["vms"].as_array().cloned())
                .unwrap_or_default();
            let awake = d.vms.iter().any(|(vm, want)| {
                *want == Want::Sleeping
                    && !rows
                        .iter()
                        .any(|r| r["vm_id"] == vm.as_str() && r["asleep"] == true)
            });
            if !awake {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends a frame to each VM `d` wants sleeping, at its address as the
    /// report says it: what wakes it.
    fn nudge(&self, d: &Desired) {
        let Some(report) = self.report() else {
            return;
        };
        let Ok(socket) = std::net::UdpSocket::bind("0.0.0.0:0") else {
            return;
        };
        let rows = report["report"]["vms"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        for (vm, want) in &d.vms {
            let ip = rows
                .iter()
                .find(|r| r["vm_id"] == vm.as_str())
                .and_then(|r| r["ip"].as_str()?.parse::<std::net::Ipv4Addr>().ok());
            if *want == Want::Sleeping
                && let Some(ip) = ip
            {
                let _ = socket.send_to(b"wake", (ip, 9));
            }
        }
    }

    /// Waits for the agent to die by its crash point, sending frames to
    /// the VMs `d` wants sleeping meanwhile; `false` if it did not reach
    /// it within `bound` (then it is killed).
    fn wait_crash(&mut self, bound: Duration, d: &Desired) -> bool {
        let until = Instant::now() + bound;
        let mut nudged = Instant::now();
        loop {
            if nudged.elapsed() >= Duration::from_millis(100) {
                self.nudge(d);
                nudged = Instant::now();
            }
            let Some(child) = self.agent.as_mut() else {
                return false;
            };
            if let Ok(Some(_)) = child.try_wait() {
                self.agent = None;
                return true;
            }
            if Instant::now() > until {
                self.kill();
                return false;
            }
            self.poll_report();
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.agent.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, and the wait for a clean exit.
    fn stop(&mut self) {
        if let Some(mut child) = self.agent.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let _ = child.wait();
        }
    }

    fn report(&self) -> Option<serde_json::Value> {
        let bytes = std::fs::read(self.state().join("report.json")).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    fn poll_report(&mut self) {
        if let Ok(bytes) = std::fs::read(self.state().join("report.json"))
            && serde_json::from_slice::<serde_json::Value>(&bytes).is_err()
        {
            self.torn_reports += 1;
        }
    }

    /// Live VMMs of this host, by VM: (pid, the root disk inode they
    /// started on, read from their log).
    fn vmms(&self) -> BTreeMap<String, Vec<(i32, u64)>> {
        let serial_prefix = format!("file={}/vms/", self.state().display());
        // A restoring VMM names its snapshot instead of its serial file.
        let restore_prefix = format!("source_url=file://{}/vms/", self.state().display());
        let mut out: BTreeMap<String, Vec<(i32, u64)>> = BTreeMap::new();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|p| p.parse::<i32>().ok())
            else {
                continue;
            };
            let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                continue;
            };
            let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map(|s| {
                    s.rsplit(')')
                        .next()
                        .unwrap_or("")
                        .trim_start()
                        .starts_with('Z')
                })
                .unwrap_or(true);
            if zombie {
                continue;
            }
            for arg in cmdline.split(|b| *b == 0) {
                let arg = String::from_utf8_lossy(arg);
                let named = arg
                    .strip_prefix(&serial_prefix)
                    .and_then(|rest| rest.strip_suffix("/serial.log"))
                    .or_else(|| {
                        let rest = arg.strip_prefix(&restore_prefix)?;
                        let (vm, tail) = rest.split_once('/')?;
                        (tail == "snapshot" || tail.starts_with("snapshot,")).then_some(vm)
                    });
                if let Some(vm) = named {
                    let ino = self.started_on(vm, pid);
                    out.entry(vm.to_owned()).or_default().push((pid, ino));
                }
            }
        }
        out
    }

    /// What is wrong with `vm`, wanted `want` with `live` VMMs, of
    /// invariant 14: a guest wanted running that is paused, a running
    /// template with no whole save, or a save left of one that is no
    /// longer a running template.
    fn running_template_problem(&self, vm: &str, want: Want, live: usize) -> Option<String> {
        let vm_dir = self.state().join("vms").join(vm);
        let running = matches!(want, Want::Running | Want::Clone | Want::LiveTemplate);
        if running && live == 1 && self.paused(vm) {
            return Some(format!("{vm}: its guest is paused, want it running"));
        }
        match want {
            Want::LiveTemplate if !vm_dir.join("template/manifest.json").is_file() => {
                Some(format!("{vm}: a running template with no whole save"))
            }
            Want::LiveTemplate => None,
            _ if vm_dir.join("template").exists() || vm_dir.join("template.raw").exists() => {
                Some(format!("{vm}: {want:?} with a template's save left"))
            }
            _ => None,
        }
    }

    /// Whether `vm`'s VMM says its guest is paused.
    fn paused(&self, vm: &str) -> bool {
        let Ok(vm_id) = eitri_agent::model::Id::parse(vm) else {
            return false;
        };
        let socket =
            eitri_agent::state::Layout::new(&self.state()).api_socket(&self.run_dir(), &vm_id);
        eitri_agent::provision::unix_http::request(
            &socket,
            "GET",
            "/api/v1/vm.info",
            None,
            Duration::from_secs(2),
        )
        .ok()
        .and_then(|(_, body)| serde_json::from_slice::<serde_json::Value>(&body).ok())
        .is_some_and(|v| v["state"] == "Paused")
    }

    fn started_on(&self, vm: &str, pid: i32) -> u64 {
        let log = self.state().join("vms").join(vm).join("hypervisor.log");
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let needle = format!("standin-disk pid={pid} ino=");
        text.lines()
            .rev()
            .find_map(|l| l.split(&needle).nth(1)?.trim().parse().ok())
            .unwrap_or(0)
    }

    /// The nonces of every snapshot the VM's VMMs restored, in order,
    /// from its hypervisor log (which every VMM of it appends to).
    fn restores(&self, vm: &str) -> Vec<String> {
        let log = self.state().join("vms").join(vm).join("hypervisor.log");
        std::fs::read_to_string(log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split("standin-restored nonce=").nth(1))
            .map(|n| n.trim().to_owned())
            .collect()
    }

    /// What is wrong with the template (invariant 12): its files written
    /// since it first converged.
    fn template_problem(&self, d: &Desired) -> Option<String> {
        let was = self.template_stamp.as_ref()?;
        if d.vms.get(TEMPLATE) != Some(&Want::Template) {
            return None;
        }
        let now = self.template_files();
        (now != *was)
            .then(|| format!("{TEMPLATE}: its snapshot or disk changed: {was:?} became {now:?}"))
    }

    /// The nonce of the snapshot `vm` holds now, if it holds one.
    fn nonce_of(&self, vm: &str) -> Option<String> {
        let state = self
            .state()
            .join("vms")
            .join(vm)
            .join("snapshot/state.json");
        let text = std::fs::read(state).ok()?;
        let v: serde_json::Value = serde_json::from_slice(&text).ok()?;
        v["nonce"].as_str().map(str::to_owned)
    }

    /// What is wrong with the clone `vm` with `live` VMMs (invariant 13):
    /// a running clone whose guest was restored from its template's copy
    /// and not given its own identity since still has its template's. (A
    /// clone booted from its own disk, after its hypervisor died, takes
    /// its identity from its own seed.) Read from its VMM's log, which
    /// each start of a VMM of it begins anew.
    fn clone_problems(&self, vm: &str, live: usize) -> Vec<String> {
        if live == 0 {
            return Vec::new();
        }
        let log = self.state().join("vms").join(vm).join("hypervisor.log");
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let Some((_, since_restore)) = text.rsplit_once("standin-restored nonce=") else {
            return Vec::new();
        };
        if since_restore.contains(&format!("standin-guest identity hostname={vm} ")) {
            Vec::new()
        } else {
            vec![format!(
                "{vm}: a running clone whose guest was not given its own identity since its restore"
            )]
        }
    }

    /// The template's snapshot files and disk: each one's path, inode,
    /// size and modification and change times; its memory's change time
    /// left out (each clone links it and is lent a read of it, which
    /// moves it), its modification time kept (root's file, 0600: no VMM
    /// may write it, nor set that time).
    fn template_files(&self) -> Vec<FileStamp> {
        let dir = self.state().join("vms").join(TEMPLATE);
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir.join("snapshot"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .collect();
        paths.push(dir.join("disk.raw"));
        paths.sort();
        paths
            .into_iter()
            .filter_map(|p| {
                let m = std::fs::metadata(&p).ok()?;
                let changed = if p.ends_with("memory-ranges") {
                    0
                } else {
                    m.ctime_nsec() + m.ctime() * 1_000_000_000
                };
                Some((
                    p.display().to_string(),
                    m.ino(),
                    m.len(),
                    m.mtime_nsec() + m.mtime() * 1_000_000_000,
                    changed,
                ))
            })
            .collect()
    }

    /// The VMs the state dir's VMM ids name (none while VMMs run unjailed).
    fn vmm_id_holders(&self) -> Vec<String> {
        std::fs::read(self.state().join("jail/ids.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<BTreeMap<String, u32>>(&b).ok())
            .map(|ids| ids.into_keys().collect())
            .unwrap_or_default()
    }

    fn records(&self) -> BTreeSet<String> {
        std::fs::read_dir(self.state().join("vms"))
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().join("record.json").exists())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    }

    /// What is wrong with the host now against `d` (empty: converged and
    /// every invariant holds but the temp-file one, checked after a stop),
    /// and the sleepers caught passing between asleep and awake (see
    /// [`PASSING`]): not wrong unless they stay so.
    fn problems(&self, d: &Desired) -> (Vec<String>, BTreeSet<String>) {
        let mut out = Vec::new();
        let mut passing = BTreeSet::new();
        let vmms = self.vmms();
        let records = self.records();
        for (vm, want) in &d.vms {
            let live = vmms.get(vm).map_or(0, Vec::len);
            let snapshot = self
                .state()
                .join("vms")
                .join(vm)
                .join("snapshot/manifest.json")
                .is_file();
            match want {
                Want::Running | Want::Clone | Want::LiveTemplate if live != 1 => {
                    out.push(format!("{vm}: {live} live VMMs, want 1"))
                }
                Want::Stopped | Want::Gone | Want::Suspended | Want::Template if live != 0 => {
                    out.push(format!("{vm}: {live} live VMMs, want none"))
                }
                Want::Sleeping if live > 1 => out.push(format!(
                    "{vm}: {live} live VMMs, want one awake or none asleep"
                )),
                _ => {}
            }
            match want {
                Want::Suspended | Want::Template if !snapshot => {
                    out.push(format!("{vm}: suspended with no whole snapshot"))
                }
                Want::Sleeping if live == 0 && !snapshot => {
                    out.push(format!("{vm}: asleep with no whole snapshot"))
                }
                Want::Sleeping if live == 1 && snapshot => {
                    passing.insert(vm.clone());
                }
                Want::Running | Want::Stopped if snapshot => {
                    out.push(format!("{vm}: {want:?} with a snapshot left"))
                }
                _ => {}
            }
            out.extend(self.running_template_problem(vm, *want, live));
            let mut restores = self.restores(vm);
            if *want == Want::Clone {
                out.extend(self.clone_problems(vm, live));
                // Each clone made again restores a fresh copy of the
                // template's snapshot, its nonce the template's.
                let template = self.nonce_of(TEMPLATE);
                restores.retain(|n| Some(n) != template.as_ref());
            }
            let mut seen = BTreeSet::new();
            if let Some(twice) = restores.iter().find(|n| !seen.insert(*n)) {
                out.push(format!("{vm}: snapshot {twice} restored twice"));
            }
            if *want == Want::Gone && records.contains(vm) {
                out.push(format!("{vm}: tombstoned, still has a record"));
            }
        }
        for (vm, pids) in &vmms {
            if !d.vms.contains_key(vm) && !records.contains(vm) {
                out.push(format!("{vm}: VMMs {pids:?} that nothing explains"));
            }
            let disk = self.state().join("vms").join(vm).join("disk.raw");
            let now = std::fs::metadata(&disk).map_or(0, |m| m.ino());
            for (pid, ino) in pids {
                if *ino != 0 && *ino != now {
                    out.push(format!("{vm}: root disk replaced under VMM {pid}"));
                }
            }
        }
        out.extend(self.template_problem(d));
        for vm in self.vmm_id_holders() {
            if !records.contains(&vm) && !vmms.contains_key(&vm) {
                out.push(format!("{vm}: holds a VMM id with no record and no VMM"));
            }
        }
        for vm in &records {
            let path = self.state().join("vms").join(vm).join("record.json");
            let ok = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                .is_some_and(|v| v["format"] == 1);
            if !ok {
                out.push(format!("{vm}: its record does not parse"));
            }
        }
        for (volume, gb) in &d.volumes {
            let meta = std::fs::metadata(self.state().join("volumes").join(volume));
            let (len, ino) = meta.map_or((0, 0), |m| (m.len(), m.ino()));
            if len != gb << 30 {
                out.push(format!("volume {volume}: {len} bytes, want {gb} GiB"));
            }
            if let Some(&was) = self.volume_inodes.get(volume)
                && was != ino
            {
                out.push(format!(
                    "volume {volume}: inode {was} became {ino}: lost and made again"
                ));
            }
        }
        self.report_problems(d, &vmms, &mut out);
        (out, passing)
    }

    /// What the report says wrong of the host against `d`, whose VMMs
    /// are `vmms`, into `out`.
    fn report_problems(
        &self,
        d: &Desired,
        vmms: &BTreeMap<String, Vec<(i32, u64)>>,
        out: &mut Vec<String>,
    ) {
        match self.report() {
            None => out.push("no report.json".into()),
            Some(r) if r["written_at_unix_ms"].as_u64().unwrap_or(0) < self.started_ms => {
                out.push("report.json not yet written by the restarted agent".into())
            }
            Some(r) => {
                let rows = r["report"]["vms"].as_array().cloned().unwrap_or_default();
                for (vm, want) in &d.vms {
                    let row = rows.iter().find(|x| x["vm_id"] == vm.as_str());
                    let says = row.map(|x| (x["power_state"].clone(), x["phase"].clone()));
                    let live = vmms.get(vm).map_or(0, Vec::len) > 0;
                    let good = match want {
                        Want::Running | Want::Clone | Want::LiveTemplate => {
                            says == Some(("running".into(), "ready".into())) && live
                        }
                        Want::Stopped => says == Some(("stopped".into(), "ready".into())),
                        Want::Suspended | Want::Template => {
                            says == Some(("suspended".into(), "ready".into()))
                        }
                        // It sleeps and wakes on its own: between the two
                        // its row narrates the pass on its way (its VMM
                        // stops before that pass ends).
                        Want::Sleeping => {
                            let asleep = row.is_some_and(|x| x["asleep"] == true);
                            let detail = row
                                .and_then(|x| x["status_detail"].as_str())
                                .unwrap_or_default();
                            let on_its_way = !detail.is_empty();
                            (says == Some(("suspended".into(), "ready".into())) && asleep && !live)
                                || (says == Some(("running".into(), "ready".into()))
                                    && (live || on_its_way))
                        }
                        Want::Gone => row.is_none(),
                    };
                    if !good {
                        let detail = row.map(|x| x["status_detail"].clone());
                        out.push(format!(
                            "{vm}: the report says {says:?} ({detail:?}), want {want:?}"
                        ));
                    }
                }
            }
        }
    }

    /// Waits for the host to converge on `d` and stay so for [`STEADY`];
    /// the time it took to converge, or the problems left at the bound, or
    /// those that appeared after it had converged (a host that flaps is
    /// not converged: a VMM killed and booted again, a row that changes).
    /// A sleeper passing between asleep and awake is not a problem, but the
    /// host is not called converged until it has passed, and one that stays
    /// so past [`PASSING`] is.
    fn converge(&mut self, d: &Desired) -> Result<Duration, Vec<String>> {
        let start = Instant::now();
        let mut converged: Option<Duration> = None;
        let mut passing_since: BTreeMap<String, Instant> = BTreeMap::new();
        loop {
            self.poll_report();
            let (mut problems, passing) = self.problems(d);
            passing_since.retain(|vm, since| {
                let still = passing.contains(vm);
                if !still {
                    self.passings.push(since.elapsed());
                }
                still
            });
            for vm in passing {
                passing_since.entry(vm).or_insert_with(Instant::now);
            }
            for (vm, since) in &passing_since {
                if since.elapsed() > PASSING {
                    problems.push(format!(
                        "{vm}: awake with a snapshot left for over {PASSING:?}"
                    ));
                }
            }
            match (problems.is_empty(), converged) {
                (true, None) => converged = Some(start.elapsed()),
                (true, Some(at)) if start.elapsed() - at >= STEADY && passing_since.is_empty() => {
                    if d.vms.get(TEMPLATE) == Some(&Want::Template) && self.template_stamp.is_none()
                    {
                        self.template_stamp = Some(self.template_files());
                    }
                    for volume in d.volumes.keys() {
                        let path = self.state().join("volumes").join(volume);
                        if let Ok(meta) = std::fs::metadata(path) {
                            self.volume_inodes.insert(volume.clone(), meta.ino());
                        }
                    }
                    return Ok(at);
                }
                (true, Some(_)) => {}
                (false, Some(_)) => {
                    return Err(problems
                        .into_iter()
                        .map(|p| format!("after converging: {p}"))
                        .collect());
                }
                (false, None) if start.elapsed() > CONVERGE => return Err(problems),
                (false, None) => {}
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The agents' log: its last `lines` lines, for a violation's message
    /// (the host's directory goes with the test).
    fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Copies the agents' whole log to `EITRI_CHAOS_KEEP/<name>.log`, when
    /// that names a directory: its tail seldom reaches back to the cause.
    fn keep_log(&self, name: &str) {
        if let Some(dir) = std::env::var_os("EITRI_CHAOS_KEEP") {
            let to = PathBuf::from(dir).join(format!("{name}.log"));
            if let Err(e) = std::fs::copy(self.dir.path().join("agent.log"), &to) {
                eprintln!("chaos: cannot keep the log in {}: {e}", to.display());
            }
        }
    }

    /// Stops the agent; what the whole run left wrong: temp files, and
    /// reads of `report.json` that did not parse.
    fn finish(&mut self) -> Vec<String> {
        self.stop();
        let mut problems: Vec<String> = self
            .temp_files()
            .into_iter()
            .map(|t| format!("temp file left: {t}"))
            .collect();
        if self.torn_reports > 0 {
            problems.push(format!(
                "{} report.json reads did not parse",
                self.torn_reports
            ));
        }
        problems
    }

    /// Temp files anywhere under the state dir (invariant 6).
    fn temp_files(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut stack = vec![self.state()];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if entry.path().is_dir() {
                    stack.push(entry.path());
                } else if (name.starts_with('.') && name.contains(".tmp-"))
                    || name.starts_with(".partial-")
                {
                    out.push(entry.path().display().to_string());
                }
            }
        }
        out
    }

    /// Stops every VMM of this host (the test's clean-up).
    fn clean_up(&mut self) {
        self.kill();
        for pids in self.vmms().values() {
            for (pid, _) in pids {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(*pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
                // Gone, so its cgroups can go.
                while std::path::Path::new(&format!("/proc/{pid}")).exists()
                    && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
                        .is_ok_and(|s| s.contains(") Z"))
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
        let root = eitri_agent::testkit::confinement(self.dir.path()).cgroup_root;
        eitri_agent::testkit::remove_cgroup_root(&root);
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.clean_up();
    }
}

fn vms(list: &[(&str, Want)]) -> Desired {
    Desired {
        vms: list.iter().map(|(id, w)| (id.to_string(), *w)).collect(),
        volumes: BTreeMap::new(),
    }
}

/// For a crash point: the desired state to converge on first (without the
/// crash), and the one whose pursuit reaches the point.
fn scenario(point: &str) -> (Desired, Desired) {
    use Want::*;
    let none = Desired::default();
    let three = vms(&[("vm-a", Running), ("vm-b", Running), ("vm-c", Stopped)]);
    match point {
        "stop.intent-saved" | "stop.done" => (
            three.clone(),
            vms(&[("vm-a", Stopped), ("vm-b", Running), ("vm-c", Stopped)]),
        ),
        "quarantine.saved" => (three.clone(), vms(&[("vm-b", Running), ("vm-c", Stopped)])),
        "suspend.intent-saved"
        | "suspend.snapshot-written"
        | "suspend.committed"
        | "suspend.vmm-stopped" => (
            three.clone(),
            vms(&[("vm-a", Suspended), ("vm-b", Running), ("vm-c", Stopped)]),
        ),
        "resume.intent-saved"
        | "resume.restore-started"
        | "resume.restored"
        | "resume.resumed"
        | "resume.snapshot-discarded"
        | "resume.guest-reseeded" => (
            vms(&[("vm-a", Suspended), ("vm-b", Running), ("vm-c", Stopped)]),
            three.clone(),
        ),
        "sleep.flags-saved" => (
            vms(&[("vm-a", Sleeping), ("vm-b", Running), ("vm-c", Stopped)]),
            vms(&[("vm-a", Sleeping), ("vm-b", Running), ("vm-c", Stopped)]),
        ),
        "wake.listening" => (
            three.clone(),
            vms(&[("vm-a", Sleeping), ("vm-b", Running), ("vm-c", Stopped)]),
        ),
        "stop.snapshot-discarded" => (
            vms(&[("vm-a", Suspended), ("vm-b", Running), ("vm-c", Stopped)]),
            vms(&[("vm-a", Stopped), ("vm-b", Running), ("vm-c", Stopped)]),
        ),
        "destroy.vmm-gone" | "store.delete-renamed" => (
            three.clone(),
            vms(&[("vm-a", Gone), ("vm-b", Running), ("vm-c", Stopped)]),
        ),
        "template.intent-saved"
        | "template.paused"
        | "template.snapshot-written"
        | "template.committed" => (
            vms(&[("vm-b", Running), ("vm-r", Running)]),
            vms(&[("vm-b", Running), ("vm-r", LiveTemplate)]),
        ),
        "create.clone-copied" | "create.clone-restored" | "create.clone-own" => (
            vms(&[(TEMPLATE, Template), ("vm-b", Running)]),
            vms(&[(TEMPLATE, Template), ("vm-b", Running), ("vm-k", Clone)]),
        ),
        "volume.created" => {
            let mut with = three.clone();
            with.volumes.insert("data-1".into(), 1);
            (none, with)
        }
        "volume.grown" => {
            let mut small = three.clone();
            small.volumes.insert("data-1".into(), 1);
            let mut grown = three.clone();
            grown.volumes.insert("data-1".into(), 2);
            (small, grown)
        }
        _ => (none, three),
    }
}

/// What the runs measured, beside the violations.
#[derive(Default)]
struct Tally {
    converge_s: Vec<f64>,
    woken: usize,
    passings: Vec<Duration>,
}

/// Runs one crash point; the problems found.
fn run_point(point: &str, tally: &mut Tally) -> Vec<String> {
    let mut host = Host::new();
    let (first, then) = scenario(point);
    host.want(&first);
    host.start(None);
    if let Err(p) = host.converge(&first) {
        return p
            .into_iter()
            .map(|p| format!("{point} (before the crash): {p}"))
            .collect();
    }
    host.stop();
    host.start(Some(point));
    host.want(&then);
    if !host.wait_crash(Duration::from_secs(20), &then) {
        return with_log(&host, vec![format!("{point}: never reached")]);
    }
    host.start(None);
    let mut problems: Vec<String> = match host.converge(&then) {
        Ok(took) => {
            tally.converge_s.push(took.as_secs_f64());
            Vec::new()
        }
        Err(p) => p,
    };
    problems.extend(host.finish());
    tally.passings.append(&mut host.passings);
    with_log(&host, problems)
        .into_iter()
        .map(|p| format!("{point}: {p}"))
        .collect()
}

/// `problems`, and when there are any, the agents' last log lines.
fn with_log(host: &Host, mut problems: Vec<String>) -> Vec<String> {
    if !problems.is_empty() {
        problems.push(format!(
            "the agents' log ends:\n{}",
            host.log_tail(LOG_LINES)
        ));
    }
    problems
}

/// The agents' log level: warnings, unless `EITRI_CHAOS_LOG` says (e.g.
/// `debug`, to find out why a violation happened).
fn log_level() -> String {
    std::env::var("EITRI_CHAOS_LOG").unwrap_or_else(|_| "warn".into())
}

/// A random desired state of up to five VMs and a volume, which may grow
/// past its largest size so far (`volume_gb`) but never shrinks: a shrink
/// is refused, which is not what this proof is about.
fn random_desired(rng: &mut XorShift, volume_gb: &mut u64) -> Desired {
    let mut d = Desired::default();
    for id in ["vm-a", "vm-b", "vm-c", "vm-d", "vm-e"] {
        let r = rng.next_unit();
        let want = if r < 0.3 {
            Some(Want::Running)
        } else if r < 0.42 {
            Some(Want::Stopped)
        } else if r < 0.54 {
            Some(Want::Suspended)
        } else if r < 0.68 {
            Some(Want::Sleeping)
        } else if r < 0.8 {
            Some(Want::Gone)
        } else {
            None
        };
        if let Some(want) = want {
            d.vms.insert(id.into(), want);
        }
    }
    // One template, always there once made (a clone whose template is
    // gone fails for good, as it must), and two clones of it; and a VM
    // running, a template or not.
    d.vms.insert(TEMPLATE.into(), Want::Template);
    let live = if rng.next_unit() < 0.6 {
        Want::LiveTemplate
    } else {
        Want::Running
    };
    d.vms.insert("vm-r".into(), live);
    for id in ["vm-k", "vm-l"] {
        let r = rng.next_unit();
        if r < 0.5 {
            d.vms.insert(id.into(), Want::Clone);
        } else if r < 0.7 {
            d.vms.insert(id.into(), Want::Gone);
        }
    }
    if rng.next_unit() < 0.5 {
        if rng.next_unit() < 0.3 && *volume_gb < 4 {
            *volume_gb += 1;
        }
        d.volumes.insert("data-1".into(), *volume_gb);
    }
    d
}

/// `n` kills at random moments of random traffic; the problems found.
fn random_kills(n: usize, seed: u64, tally: &mut Tally) -> Vec<String> {
    let mut rng = XorShift::from_seed(seed);
    let mut host = Host::new();
    let mut problems = Vec::new();
    let mut desired = Desired::default();
    let mut volume_gb = 1;
    host.want(&desired);
    host.start(None);
    for kill in 0..n {
        // VMs absent from the new state but once wanted stay quarantined
        // (the vanish grace is long): they are explained by their records.
        desired = random_desired(&mut rng, &mut volume_gb);
        host.want(&desired);
        std::thread::sleep(Duration::from_millis((rng.next_unit() * 300.0) as u64));
        // Frames for the sleepers, so some kills land in a wake.
        host.nudge(&desired);
        std::thread::sleep(Duration::from_millis((rng.next_unit() * 50.0) as u64));
        host.kill();
        host.start(None);
        match host.converge(&desired) {
            Ok(took) => {
                tally.converge_s.push(took.as_secs_f64());
                // Frames for this agent's sleepers, once they sleep (one
                // woken before runs its idle second first, and the idle watch
                // reads once a second): the next kill
                // may land in their wake, or in their next sleep.
                host.until_asleep(&desired, Duration::from_secs(3));
                host.nudge(&desired);
                std::thread::sleep(Duration::from_millis(300));
                let rows = host
                    .report()
                    .and_then(|r| r["report"]["vms"].as_array().cloned())
                    .unwrap_or_default();
                if rows
                    .iter()
                    .any(|r| r["last_wake"].as_str().is_some_and(|w| !w.is_empty()))
                {
                    tally.woken += 1;
                }
            }
            Err(p) => {
                problems.extend(p.into_iter().map(|p| format!("kill {kill}: {p}")));
                // The log as it was then: by the end of the run, the
                // lines that say why are long gone from its tail.
                problems.push(format!(
                    "kill {kill}: the agents' log then ends:\n{}",
                    host.log_tail(LOG_LINES)
                ));
                host.keep_log(&format!("kill-{kill}"));
            }
        }
    }
    problems.extend(host.finish());
    tally.passings.append(&mut host.passings);
    with_log(&host, problems)
}

/// Every crash point, then `kills` random kills.
pub fn run(kills: usize) -> Summary {
    let mut tally = Tally::default();
    let mut violations = Vec::new();
    // `EITRI_CHAOS_POINT` runs only the points it names (comma-separated):
    // for chasing one violation.
    let only = std::env::var("EITRI_CHAOS_POINT").ok();
    let chosen: Vec<&str> = eitri_agent::crash::POINTS
        .iter()
        .map(|(point, _)| *point)
        .filter(|point| {
            only.as_ref()
                .is_none_or(|o| o.split(',').any(|x| x == *point))
        })
        .collect();
    for point in &chosen {
        violations.extend(run_point(point, &mut tally));
    }
    violations.extend(random_kills(kills, 0x000c_4a05, &mut tally));
    // Every random kill is followed by frames for the sleepers: a run in
    // which none woke proved nothing of a kill in a wake, and says the
    // frames went elsewhere (another link with the guests' subnet).
    if kills > 0 && tally.woken == 0 {
        violations.push(format!(
            "no sleeper woke after any of the {kills} random kills: the frames sent to wake them reached none (is another link routed the guests' subnet?)"
        ));
    }
    tally.converge_s.sort_by(f64::total_cmp);
    Summary {
        points: eitri_agent::crash::POINTS.len(),
        point_runs: chosen.len(),
        random_kills: kills,
        violations,
        converge_s: tally.converge_s,
        woken: tally.woken,
        passings: tally.passings.len(),
        passing_longest: tally.passings.into_iter().max().unwrap_or_default(),
    }
}

impl Summary {
    pub fn line(&self) -> String {
        let pct = |p: f64| {
            if self.converge_s.is_empty() {
                return 0.0;
            }
            let i = ((self.converge_s.len() as f64 - 1.0) * p).round() as usize;
            self.converge_s[i]
        };
        format!(
            "bench=chaos points={} point_runs={} random_kills={} woken={} passings={} passing_ms_max={} violations={} converge_s_p50={:.3} converge_s_p99={:.3}",
            self.points,
            self.point_runs,
            self.random_kills,
            self.woken,
            self.passings,
            self.passing_longest.as_millis(),
            self.violations.len(),
            pct(0.5),
            pct(0.99)
        )
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
