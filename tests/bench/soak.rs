//! `make soak`: a host that runs for a long time, in minutes. One agent
//! (the stand-in hypervisor, guest networking on, in a network namespace
//! of the soak's own) lives through `EITRI_SOAK_ROUNDS` rounds (default
//! 500, about four and a half minutes here). Each round creates two VMs,
//! suspends and resumes one, kills its VMM (the agent boots it again),
//! stops the other, rotates the key of the VMs that stay, destroys both;
//! every tenth round the agent is stopped, or killed, and started again;
//! and a second agent on a new state dir, with a guest network of its own,
//! boots a VM, destroys it and is then released, or abandoned (its state
//! dir deleted, for the next agent that starts to reap).
//!
//! Every host resource the agent can add is counted after a warm-up and
//! after the last round, each time on the same desired state (two VMs that
//! stay) and with an agent that adopted those two at its start, as the
//! agent at the end did: one line per resource, `before -> after`. Any growth fails the
//! run, but the agent's resident memory's, which may grow by a quarter (an
//! allocator's pages are not a leak; a growth past that is). The last line
//! is `bench=soak rounds=… resources=… grown=… seconds=…`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const AGENT: &str = env!("CARGO_BIN_EXE_eitri-agent");
const STANDIN: &str = env!("CARGO_BIN_EXE_eitri-standin-hypervisor");
/// How long one step may take to converge before the soak fails.
const PATIENCE: Duration = Duration::from_secs(60);
/// The VMs that stay through the soak, and the two keys they rotate.
const STAYING: [&str; 2] = ["stay-1", "stay-2"];
const KEYS: [&str; 2] = [
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKsoakKeyOneOneOneOneOneOneOneOneOneOneOne soak-1",
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKsoakKeyTwoTwoTwoTwoTwoTwoTwoTwoTwoTwoTwo soak-2",
];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Want {
    Running,
    Stopped,
    Suspended,
    Gone,
}

impl Want {
    fn power(self) -> &'static str {
        match self {
            Want::Running | Want::Gone => "running",
            Want::Stopped => "stopped",
            Want::Suspended => "suspended",
        }
    }
}

/// What an agent is asked for: VMs by id, each with what it should be, and
/// the key of the VMs that stay.
#[derive(Clone)]
struct Desired {
    vms: BTreeMap<String, Want>,
    key: &'static str,
}

impl Desired {
    fn staying(key: &'static str) -> Desired {
        Desired {
            vms: STAYING
                .iter()
                .map(|v| (v.to_string(), Want::Running))
                .collect(),
            key,
        }
    }

    fn with(mut self, vm: &str, want: Want) -> Desired {
        self.vms.insert(vm.into(), want);
        self
    }
}

/// One agent process over one state dir.
struct Agent {
    child: Option<Child>,
    state: PathBuf,
    desired: PathBuf,
    started_ms: u64,
}

struct Soak {
    dir: tempfile::TempDir,
    base_url: String,
    base_sha: String,
    confinement: eitri_agent::provision::Confinement,
    main: Agent,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Soak {
    fn new() -> Soak {
        let dir = tempfile::tempdir().expect("tempdir");
        eitri_agent::testkit::remove_on_signal(dir.path());
        let library = dir.path().join("library");
        std::fs::create_dir(&library).expect("image root");
        let base = library.join("base.raw");
        std::fs::write(&base, vec![0x5au8; 1 << 20]).expect("base");
        std::fs::write(dir.path().join("vmlinux"), b"k").expect("kernel");
        eitri_agent::testkit::standin_hypervisor(Path::new(STANDIN), &dir.path().join("hv"), &[]);
        let confinement = eitri_agent::testkit::confinement(dir.path());
        let main = Agent {
            child: None,
            state: dir.path().join("state"),
            desired: dir.path().join("desired.json"),
            started_ms: 0,
        };
        Soak {
            base_url: format!("file://{}", base.display()),
            base_sha: eitri_agent::image::sha256_file(&base).expect("hash"),
            confinement,
            dir,
            main,
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Writes `d` as `agent`'s desired file (a new file renamed over it,
    /// as an operator's tool would).
    fn want(&self, agent: &Agent, d: &Desired) {
        let vms: Vec<String> = d
            .vms
            .iter()
            .map(|(vm, want)| {
                let key = if STAYING.contains(&vm.as_str()) {
                    d.key
                } else {
                    KEYS[0]
                };
                format!(
                    r#"{{"vm_id":"{vm}","name":"{vm}","image_url":"{}","image_sha256":"{}","vcpus":1,"mem_mb":128,"disk_gb":1,"power_state":"{}","tombstoned":{},"ssh_authorized_key":"{key}"}}"#,
                    self.base_url,
                    self.base_sha,
                    want.power(),
                    *want == Want::Gone
                )
            })
            .collect();
        let temp = agent.desired.with_extension("tmp");
        std::fs::write(&temp, format!(r#"{{"vms":[{}]}}"#, vms.join(","))).expect("desired");
        std::fs::rename(&temp, &agent.desired).expect("rename");
    }

    /// Starts `agent`; `extra` are its own flags (the main agent's network).
    fn start(&self, agent: &mut Agent, cgroup_root: &str, extra: &[&str]) {
        let run = agent.state.with_extension("run");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.path("agents.log"))
            .expect("log");
        let mut cmd = Command::new(AGENT);
        cmd.args(["run", "--state-dir"])
            .arg(&agent.state)
            .arg("--desired")
            .arg(&agent.desired)
            .arg("--run-dir")
            .arg(&run)
            .arg("--hypervisor")
            .arg(self.path("hv"))
            .arg("--kernel")
            .arg(self.path("vmlinux"))
            .arg("--image-root")
            .arg(self.path("library"))
            .args(self.host_flags())
            .arg("--cgroup-root")
            .arg(cgroup_root)
            .args(["--tick", "200ms", "--tombstone-grace", "0"])
            .args(["--shutdown-grace", "5s"])
            .args(extra)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("EITRI_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        agent.started_ms = unix_ms();
        agent.child = Some(cmd.spawn().expect("agent"));
    }

    /// The host-wide flags every agent of the soak and `release` share:
    /// the registry and the devices its VMMs' group is given.
    fn host_flags(&self) -> [std::ffi::OsString; 6] {
        [
            "--agents-dir".into(),
            self.path("agents").into(),
            "--kvm-device".into(),
            self.confinement.kvm.clone().into(),
            "--userfaultfd-device".into(),
            self.userfaultfd().into(),
        ]
    }

    fn userfaultfd(&self) -> PathBuf {
        self.confinement
            .userfaultfd
            .clone()
            .expect("the soak's userfaultfd file")
    }

    fn start_main(&mut self) {
        let mut main = std::mem::replace(&mut self.main, placeholder());
        let root = self.confinement.cgroup_root.clone();
        self.start(
            &mut main,
            &root,
            &[
                "--underlay-bridge",
                "etsoak0",
                "--underlay-subnet",
                "100.79.0.0/16",
                "--tap-prefix",
                "etsk",
            ],
        );
        self.main = main;
    }

    /// Waits until `agent` reports `d` whole (and its VMMs agree).
    fn converge(&self, agent: &Agent, d: &Desired, what: &str) {
        let until = Instant::now() + PATIENCE;
        loop {
            let problems = problems(agent, d, &self.path("hv"));
            if problems.is_empty() {
                return;
            }
            if Instant::now() > until {
                panic!(
                    "{what}: did not converge in {PATIENCE:?}: {problems:?}\nthe log's end:\n{}",
                    tail(&self.path("agents.log"), 40)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Tells `agent` to want `d`, then waits for it.
    fn drive(&self, agent: &Agent, d: &Desired, what: &str) {
        self.want(agent, d);
        self.converge(agent, d, what);
    }

    /// One round of churn on the main agent and a second agent; `round`
    /// picks what happens to the agent (every tenth round from the fifth
    /// it is stopped, or killed, and started again) and to the second
    /// state dir (released, or abandoned).
    fn round(&mut self, round: usize) {
        self.churn(round);
        match round % 20 {
            5 => self.restart_main(Signal::SIGTERM),
            15 => self.restart_main(Signal::SIGKILL),
            _ => {}
        }
        self.converge(
            &self.main,
            &Desired::staying(KEYS[round % 2]),
            "the agent again",
        );
        self.second_agent(round, round.is_multiple_of(2));
    }

    /// The main agent's VMs through their life: two made, one suspended,
    /// resumed and its VMM killed, the other stopped, both destroyed; the
    /// staying VMs' key rotated.
    fn churn(&self, round: usize) {
        let key = KEYS[round % 2];
        let (a, b) = (format!("churn-{round}-a"), format!("churn-{round}-b"));
        let staying = Desired::staying(key);
        let both = |wa, wb| staying.clone().with(&a, wa).with(&b, wb);

        self.drive(&self.main, &both(Want::Running, Want::Running), "create");
        self.drive(&self.main, &both(Want::Suspended, Want::Running), "suspend");
        self.drive(&self.main, &both(Want::Running, Want::Running), "resume");
        let killed = vmm_pids(&self.main.state, &a, &self.path("hv"));
        for pid in &killed {
            let _ = kill(Pid::from_raw(*pid), Signal::SIGKILL);
        }
        let until = Instant::now() + PATIENCE;
        while vmm_pids(&self.main.state, &a, &self.path("hv")) == killed {
            assert!(Instant::now() < until, "{a}'s VMM was never booted again");
            std::thread::sleep(Duration::from_millis(20));
        }
        self.converge(&self.main, &both(Want::Running, Want::Running), "reboot");
        self.drive(&self.main, &both(Want::Running, Want::Stopped), "stop");
        self.drive(&self.main, &both(Want::Gone, Want::Gone), "destroy");
        self.drive(&self.main, &staying, "forget");
    }

    fn restart_main(&mut self, signal: Signal) {
        stop(&mut self.main, signal);
        self.start_main();
    }

    /// A second agent on a new state dir boots a VM and destroys it; its
    /// state dir is then released, or abandoned (deleted) for the next
    /// agent to start to reap.
    fn second_agent(&self, n: usize, release: bool) {
        let others = self.path("others");
        std::fs::create_dir_all(&others).expect("others");
        let mut agent = Agent {
            child: None,
            state: others.join(format!("s{n}")),
            desired: others.join(format!("s{n}.json")),
            started_ms: 0,
        };
        let vm = format!("other-{n}");
        let one = Desired {
            vms: BTreeMap::new(),
            key: KEYS[0],
        };
        self.want(&agent, &one.clone().with(&vm, Want::Running));
        let root = format!("{}-s{n}", self.confinement.cgroup_root);
        let (bridge, prefix) = (format!("etso{n}"), format!("eo{n}"));
        self.start(
            &mut agent,
            &root,
            &[
                "--underlay-bridge",
                &bridge,
                "--underlay-subnet",
                "100.80.0.0/16",
                "--tap-prefix",
                &prefix,
            ],
        );
        self.converge(
            &agent,
            &one.clone().with(&vm, Want::Running),
            "a second agent",
        );
        self.drive(
            &agent,
            &one.clone().with(&vm, Want::Gone),
            "its VM destroyed",
        );
        stop(&mut agent, Signal::SIGTERM);
        if release {
            let out = Command::new(AGENT)
                .arg("release")
                .arg("--state-dir")
                .arg(&agent.state)
                .args(self.host_flags())
                .output()
                .expect("release");
            assert!(
                out.status.success(),
                "release {}: {}",
                agent.state.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::fs::remove_dir_all(&agent.state).expect("the state dir gone");
        let _ = std::fs::remove_dir_all(agent.state.with_extension("run"));
        let _ = std::fs::remove_file(&agent.desired);
    }

    /// [`Soak::count`] once the agent is quiet: its workers of VMs just
    /// destroyed have ended.
    fn settled_count(&self) -> BTreeMap<String, u64> {
        std::thread::sleep(Duration::from_secs(2));
        self.count()
    }

    /// What the main agent's fds are open on, to say what a growth is.
    fn agent_fds(&self) -> Vec<String> {
        let pid = self.main.child.as_ref().expect("the agent runs").id();
        let mut out: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| std::fs::read_link(e.path()).ok())
            .map(|t| t.display().to_string())
            .collect();
        out.sort();
        out
    }

    /// Every host resource the agent can add, by name.
    fn count(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        let pid = self.main.child.as_ref().expect("the agent runs").id();
        let proc_dir = PathBuf::from(format!("/proc/{pid}"));
        out.insert("agent fds".into(), entries(&proc_dir.join("fd")));
        out.insert("agent threads".into(), entries(&proc_dir.join("task")));
        out.insert("agent rss KiB".into(), rss_kib(&proc_dir));
        for (name, count) in cgroup_dirs() {
            out.insert(format!("cgroup dirs {name}"), count);
        }
        for (name, path) in [
            ("kvm", self.confinement.kvm.clone()),
            ("userfaultfd", self.userfaultfd()),
        ] {
            let groups = eitri_agent::provision::jail::acl::named_groups(&path).expect("ACL");
            out.insert(format!("acl entries {name}"), groups.len() as u64);
        }
        let links = run("ip", &["-o", "link", "show"]);
        out.insert("links (taps, bridges)".into(), links.lines().count() as u64);
        out.insert("named netns".into(), entries(Path::new("/run/netns")));
        for (what, n) in nft_counts() {
            out.insert(format!("nft {what}"), n);
        }
        out.insert("registry entries".into(), entries(&self.path("agents")));
        out.insert(
            "files under the state dir".into(),
            files_under(&self.main.state),
        );
        out.insert(
            "processes of the soak".into(),
            processes_naming(self.dir.path()),
        );
        out
    }
}

fn placeholder() -> Agent {
    Agent {
        child: None,
        state: PathBuf::new(),
        desired: PathBuf::new(),
        started_ms: 0,
    }
}

fn stop(agent: &mut Agent, signal: Signal) {
    if let Some(mut child) = agent.child.take() {
        let _ = kill(Pid::from_raw(child.id() as i32), signal);
        let _ = child.wait();
    }
}

fn report(agent: &Agent) -> Option<serde_json::Value> {
    let bytes = std::fs::read(agent.state.join("report.json")).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// What keeps `agent` from having converged on `d`: each VM's row and
/// live VMMs, rows of VMs it was not asked for, a report not yet its own.
fn problems(agent: &Agent, d: &Desired, hv: &Path) -> Vec<String> {
    let Some(r) = report(agent) else {
        return vec!["no report".into()];
    };
    if r["written_at_unix_ms"].as_u64().unwrap_or(0) < agent.started_ms {
        return vec!["the report is the last agent's".into()];
    }
    let rows = r["report"]["vms"].as_array().cloned().unwrap_or_default();
    let mut out = Vec::new();
    for (vm, want) in &d.vms {
        let row = rows.iter().find(|x| x["vm_id"] == vm.as_str());
        let says = row.map(|x| (x["power_state"].clone(), x["phase"].clone()));
        let live = vmm_pids(&agent.state, vm, hv).len();
        let good = match want {
            Want::Running => says == Some(("running".into(), "ready".into())) && live == 1,
            Want::Stopped => says == Some(("stopped".into(), "ready".into())) && live == 0,
            Want::Suspended => says == Some(("suspended".into(), "ready".into())) && live == 0,
            Want::Gone => row.is_none() && live == 0,
        };
        if !good {
            out.push(format!("{vm}: {says:?} with {live} VMMs, want {want:?}"));
        }
    }
    for row in &rows {
        let vm = row["vm_id"].as_str().unwrap_or_default();
        if !d.vms.contains_key(vm) {
            out.push(format!("{vm}: a row nothing asks for"));
        }
    }
    out
}

/// The live VMMs (the stand-in `hv`) of `vm` under `state`.
fn vmm_pids(state: &Path, vm: &str, hv: &Path) -> Vec<i32> {
    let mark = format!("{}/vms/{vm}/", state.display());
    let hv = hv.display().to_string();
    let mut out: Vec<i32> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline);
            let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| s.contains(") Z"));
            cmdline.starts_with(hv.as_str()) && cmdline.contains(&mark) && !zombie
        })
        .collect();
    out.sort_unstable();
    out
}

fn entries(dir: &Path) -> u64 {
    std::fs::read_dir(dir).map_or(0, |d| d.count() as u64)
}

fn files_under(dir: &Path) -> u64 {
    let mut count = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            match entry.file_type() {
                Ok(t) if t.is_dir() => stack.push(entry.path()),
                _ => count += 1,
            }
        }
    }
    count
}

fn rss_kib(proc_dir: &Path) -> u64 {
    std::fs::read_to_string(proc_dir.join("status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Directories in each cgroup hierarchy mounted here, by hierarchy.
fn cgroup_dirs() -> BTreeMap<String, u64> {
    let mut seen = std::collections::BTreeSet::new();
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir("/sys/fs/cgroup")
        .into_iter()
        .flatten()
        .flatten()
    {
        let Ok(real) = std::fs::canonicalize(entry.path()) else {
            continue;
        };
        if !real.is_dir() || !seen.insert(real.clone()) {
            continue;
        }
        let mut count = 0;
        let mut stack = vec![real];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    count += 1;
                    stack.push(e.path());
                }
            }
        }
        out.insert(entry.file_name().to_string_lossy().into_owned(), count);
    }
    out
}

/// Tables, chains, rules, sets and set elements in this namespace's nft.
fn nft_counts() -> BTreeMap<&'static str, u64> {
    let text = run("nft", &["-j", "list", "ruleset"]);
    let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    let mut out: BTreeMap<&'static str, u64> = ["tables", "chains", "rules", "sets", "elements"]
        .into_iter()
        .map(|k| (k, 0))
        .collect();
    for item in json["nftables"].as_array().into_iter().flatten() {
        for (kind, name) in [("table", "tables"), ("chain", "chains"), ("rule", "rules")] {
            if item.get(kind).is_some() {
                *out.entry(name).or_default() += 1;
            }
        }
        if let Some(set) = item.get("set").or_else(|| item.get("map")) {
            *out.entry("sets").or_default() += 1;
            let elems = set["elem"].as_array().map_or(0, Vec::len);
            *out.entry("elements").or_default() += elems as u64;
        }
    }
    out
}

/// Processes whose command line names `dir`: the agents and their VMMs.
fn processes_naming(dir: &Path) -> u64 {
    let mark = dir.display().to_string();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.parse::<u32>().is_ok())
        })
        .filter(|e| {
            let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            String::from_utf8_lossy(&cmdline).contains(&mark)
        })
        .count() as u64
}

fn run(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Whether `before -> after` of `name` is growth the soak fails on.
fn grew(name: &str, before: u64, after: u64) -> bool {
    if name == "agent rss KiB" {
        after > before + before / 4
    } else {
        after > before
    }
}

impl Drop for Soak {
    fn drop(&mut self) {
        stop(&mut self.main, Signal::SIGKILL);
        let root = self.confinement.cgroup_root.clone();
        eitri_agent::testkit::end_cgroup_root(&root);
        eitri_agent::testkit::remove_cgroup_root(&root);
    }
}

fn main() {
    let rounds: usize = std::env::var("EITRI_SOAK_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(500);
    eitri_agent::testkit::net::private_network();
    let began = Instant::now();
    let mut soak = Soak::new();
    soak.start_main();
    // The warm-up: every kind of thing once, an agent started again (it
    // adopts the staying VMs, as the agent at the end has), one round of
    // churn more; then the desired state the soak ends on.
    soak.round(0);
    soak.restart_main(Signal::SIGTERM);
    soak.churn(9999);
    let staying = Desired::staying(KEYS[0]);
    soak.drive(&soak.main, &staying, "after the warm-up");
    let before = soak.settled_count();
    let fds_before = soak.agent_fds();

    for round in 1..=rounds {
        soak.round(round);
        eprintln!(
            "soak: round {round} of {rounds} at {:.0} s",
            began.elapsed().as_secs_f64()
        );
    }
    // The same desired state as before, and a last second agent released,
    // which reaps the claim the last round abandoned.
    soak.drive(&soak.main, &staying, "after the last round");
    soak.second_agent(rounds + 1, true);
    let after = soak.settled_count();
    let fds_after = soak.agent_fds();

    let mut grown = 0;
    for (name, was) in &before {
        let now = after.get(name).copied().unwrap_or(0);
        let bad = grew(name, *was, now);
        grown += usize::from(bad);
        println!(
            "{name:<28} {was:>8} -> {now:<8} {}",
            if bad { "GREW" } else { "flat" }
        );
    }
    if grew("agent fds", before["agent fds"], after["agent fds"]) {
        println!("the agent's fds before: {fds_before:?}");
        println!("the agent's fds after:  {fds_after:?}");
    }
    println!(
        "bench=soak rounds={rounds} resources={} grown={grown} seconds={:.0}",
        before.len(),
        began.elapsed().as_secs_f64()
    );
    drop(soak);
    if grown > 0 {
        std::process::exit(1);
    }
}
