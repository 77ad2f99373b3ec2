//! The lab a real-guest test runs in: the real agent binary in standalone
//! mode, driving a real cloud-hypervisor that boots a real Linux guest
//! (kernel and root filesystem from the environment), all inside a network
//! namespace of the test's own, so the agent's bridge, taps, firewall
//! tables and the guests' traffic never touch the host's network.
//!
//! What a test needs from it, in the order it uses them:
//! 1. [`Lab::open`]: the real parts from the environment (or the reason
//!    the test is skipped), a private network namespace, a temp dir, a
//!    client SSH key.
//! 2. [`Lab::start`]: the agent, with the test's extra flags.
//! 3. [`Lab::desire`] and [`Lab::wait_row`]: desired state written as an
//!    operator writes it, and the agent's report read back, each wait
//!    timed.
//! 4. [`Lab::ssh`]: the guest, as its tenant reaches it.
//!
//! On drop the agent is killed and every process in the test's cgroup
//! root (the VMMs outlive their agent by design) is ended with it.

use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde_json::{Value, json};

/// Where the real parts are named; `make e2e-real` sets them.
pub const HYPERVISOR_VAR: &str = "EITRI_TEST_CLOUD_HYPERVISOR";
pub const KERNEL_VAR: &str = "EITRI_TEST_LINUX_KERNEL";
pub const IMAGE_VAR: &str = "EITRI_TEST_LINUX_IMAGE";
/// Set (to anything) to keep a failed test's lab dir: the agent's log, its
/// state dir, each VMM's log and console, for reading afterwards.
pub const KEEP_VAR: &str = "EITRI_TEST_KEEP_FAILED";

/// The image's user (cloud-init's default user on Debian).
pub const USER: &str = "debian";
/// The root filesystem has no partition table.
const CMDLINE: &str = "console=ttyS0 root=/dev/vda rw";
/// How long a guest is given to power off after the power button.
pub const STOP_GRACE_S: u64 = 60;
/// A readiness probe's period. A real guest under this host's software
/// KVM takes 30-60 s to boot (two at once on two cores), so the grace is
/// long: a bound to fail on, not a measurement.
pub const PROBE_PERIOD_S: u64 = 2;
const PROBE_GRACE_S: u64 = 300;
/// Bounds for a test to fail on, not measurements: a boot, and anything
/// that takes a tick or a few.
pub const BOOT: Duration = Duration::from_secs(300);
pub const SOON: Duration = Duration::from_secs(60);

/// The real parts a test boots, from the environment.
pub struct Parts {
    pub hypervisor: PathBuf,
    pub kernel: PathBuf,
    pub image: PathBuf,
}

impl Parts {
    /// The parts the environment names, or why the test cannot run here.
    fn from_env() -> Result<Parts, String> {
        let named = |var: &str| std::env::var_os(var).map(PathBuf::from);
        let (Some(hypervisor), Some(kernel), Some(image)) =
            (named(HYPERVISOR_VAR), named(KERNEL_VAR), named(IMAGE_VAR))
        else {
            return Err(format!(
                "set {HYPERVISOR_VAR} (a cloud-hypervisor binary), {KERNEL_VAR} (a Linux kernel it \
                 boots with --kernel) and {IMAGE_VAR} (a raw root filesystem with cloud-init and \
                 sshd), or run make e2e-real, which builds them"
            ));
        };
        for path in [&hypervisor, &kernel, &image] {
            if !path.is_file() {
                return Err(format!("{} does not exist", path.display()));
            }
        }
        if !Path::new("/dev/kvm").exists() {
            return Err("this machine has no /dev/kvm".into());
        }
        Ok(Parts {
            hypervisor,
            kernel,
            image,
        })
    }
}

/// One test's agent, its state and its guests.
pub struct Lab {
    pub dir: tempfile::TempDir,
    pub parts: Parts,
    image_sha256: String,
    /// The test's client key pair (`key`, `key.pub`).
    pub key: PathBuf,
    pub cgroup_root: String,
    agent: Option<Child>,
    started: Option<Instant>,
}

impl Lab {
    /// The lab, or `None` after printing why the test is skipped. Call it
    /// first: it moves the test process into a network namespace of its
    /// own, which needs the process to have one thread.
    pub fn open(test: &str) -> Option<Lab> {
        let parts = match Parts::from_env() {
            Ok(parts) => parts,
            Err(why) => {
                println!("SKIPPED {test}: {why}");
                return None;
            }
        };
        eitri_agent::testkit::net::private_network();
        eitri_agent::testkit::sweep_stale_test_roots();
        let cgroup_root = format!("eitri-test-{}", std::process::id());
        eitri_agent::testkit::end_when_signalled(cgroup_root.clone());
        ip(&["link", "set", "lo", "up"]);
        let dir = tempfile::tempdir().expect("tempdir");
        // A guest's disk is a GiB: gone with the lab, even at ^C.
        eitri_agent::testkit::remove_on_signal(dir.path());
        // The jailed VMM must reach nothing here but what it is given.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711))
            .expect("chmod");
        let key = dir.path().join("key");
        run(eitri_agent::testkit::tools::tool("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-C", "tenant", "-f"])
            .arg(&key));
        let image_sha256 = eitri_agent::image::sha256_file(&parts.image).expect("hash the image");
        Some(Lab {
            dir,
            parts,
            image_sha256,
            key,
            cgroup_root,
            agent: None,
            started: None,
        })
    }

    pub fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("agent.log")
    }

    /// Starts the agent with `extra` flags beside the lab's own.
    pub fn start(&mut self, extra: &[&str]) {
        let path = |p: &Path| p.display().to_string();
        let image_root = self.parts.image.parent().expect("the image's directory");
        let (first, count) = eitri_agent::testkit::test_vmm_ids();
        let vmm_ids = format!("{first}:{count}");
        let mut args: Vec<String> = [
            "run",
            "--state-dir",
            &path(&self.state()),
            "--desired",
            &path(&self.dir.path().join("desired.json")),
            "--tick",
            "1s",
            "--run-dir",
            &path(&self.dir.path().join("run")),
            "--agents-dir",
            &path(&self.dir.path().join("agents")),
            "--hypervisor",
            &path(&self.parts.hypervisor),
            "--kernel",
            &path(&self.parts.kernel),
            "--cmdline",
            CMDLINE,
            "--image-root",
            &path(image_root),
            "--cgroup-root",
            &self.cgroup_root,
            // The test process's own ids (never an agent's range): its
            // group's ACL entry on the host's devices is taken back at the
            // lab's end.
            "--vmm-ids",
            &vmm_ids,
            "--underlay-bridge",
            "etrbr0",
            // The links a test makes itself are named apart from this: the
            // port guard drops every frame a link with it sends unguarded.
            "--tap-prefix",
            "etr",
            "--stop-grace",
            &format!("{STOP_GRACE_S}s"),
            "--tombstone-grace",
            "1s",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        // A test's own command line replaces the lab's.
        if extra.contains(&"--cmdline") {
            let at = args
                .iter()
                .position(|a| a == "--cmdline")
                .expect("the lab's");
            args.drain(at..at + 2);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        if !self.dir.path().join("desired.json").exists() {
            self.desire(&[]);
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log())
            .expect("agent log");
        let child = Command::new(env!("CARGO_BIN_EXE_eitri-agent"))
            .args(&args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start the agent");
        self.agent = Some(child);
        self.started.get_or_insert_with(Instant::now);
    }

    /// Kills the agent with SIGKILL, leaving its VMMs running.
    pub fn kill_agent(&mut self) {
        if let Some(mut child) = self.agent.take() {
            child.kill().expect("SIGKILL the agent");
            child.wait().expect("reap the agent");
        }
    }

    /// Writes the desired state the way an operator does: a new file
    /// renamed over the old one.
    pub fn desire(&self, vms: &[Value]) {
        let temp = self.dir.path().join(".desired.tmp");
        std::fs::write(&temp, json!({ "vms": vms }).to_string()).expect("write desired");
        std::fs::rename(temp, self.dir.path().join("desired.json")).expect("rename desired");
    }

    /// A desired VM booting the lab's image: 1 vCPU (two guests of two on
    /// two cores boot in twice the time), 512 MiB, a 2 GiB disk, the lab's
    /// key, ready when sshd answers.
    pub fn vm(&self, id: &str) -> Value {
        json!({
            "vm_id": id,
            "name": id,
            "image_url": format!("file://{}", self.parts.image.display()),
            "image_sha256": self.image_sha256,
            "ssh_authorized_key": self.public_key(),
            "vcpus": 1,
            "mem_mb": 512,
            "disk_gb": 2,
            "power_state": "running",
            "readiness": {"tcp_port": 22, "period_s": PROBE_PERIOD_S, "grace_s": PROBE_GRACE_S},
        })
    }

    pub fn public_key(&self) -> String {
        read(&self.key.with_extension("pub")).trim().to_owned()
    }

    /// The last report the agent wrote.
    pub fn report(&self) -> Option<Value> {
        let text = std::fs::read(self.state().join("report.json")).ok()?;
        serde_json::from_slice(&text).ok()
    }

    /// Waits until the VM's row passes `done`, at most `patience`; the
    /// row, and how long it took. On timing out, fails with the last row,
    /// the agent's log and the guest's console.
    pub fn wait_row(
        &self,
        id: &str,
        what: &str,
        patience: Duration,
        done: impl Fn(&Value) -> bool,
    ) -> (Value, Duration) {
        let (report, took) = self.wait_report(id, what, patience, done);
        (row_of(&report, id), took)
    }

    /// As [`Lab::wait_row`], returning the whole report whose row passed.
    pub fn wait_report(
        &self,
        id: &str,
        what: &str,
        patience: Duration,
        done: impl Fn(&Value) -> bool,
    ) -> (Value, Duration) {
        let started = Instant::now();
        loop {
            let report = self.report().unwrap_or_default();
            let row = row_of(&report, id);
            if done(&row) {
                return (report, started.elapsed());
            }
            if started.elapsed() > patience {
                panic!(
                    "{id}: timed out after {patience:?} waiting for {what}; its last row: {row}\n\
                     the agent's log (end):\n{}\nthe guest's console (end):\n{}",
                    tail(&read(&self.log()), 40),
                    self.console(id, 40)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Writes `vms` as the desired state and waits until `id` is running
    /// and ready; its row and how long that took.
    pub fn boot(&self, vms: &[Value], id: &str) -> (Value, Duration) {
        self.desire(vms);
        let (row, took) = self.wait_row(id, "running and ready", BOOT, ready);
        timing("desired -> ready", took);
        (row, took)
    }

    /// The VM's details in the last report (its VMM's pid among them).
    pub fn details(&self, id: &str) -> Value {
        self.report()
            .map_or(Value::Null, |r| r["details"][id].clone())
    }

    /// The last `lines` of the guest's console, as `eitri-agent logs` shows it.
    pub fn console(&self, id: &str, lines: usize) -> String {
        let out = Command::new(env!("CARGO_BIN_EXE_eitri-agent"))
            .args(["logs", id, "--state-dir"])
            .arg(self.state())
            .args(["--lines", &lines.to_string()])
            .output()
            .expect("eitri-agent logs");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// What happened to `id`, as `eitri-agent events` prints it.
    pub fn events(&self, id: &str) -> String {
        let out = Command::new(env!("CARGO_BIN_EXE_eitri-agent"))
            .args(["events", id, "--state-dir"])
            .arg(self.state())
            .output()
            .expect("eitri-agent events");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// What the agent logged so far.
    pub fn agent_log(&self) -> String {
        read(&self.log())
    }

    /// `command` run in the guest at `ip` by `user` over SSH, with the
    /// lab's key, trusting whatever host key it presents.
    pub fn ssh(&self, user: &str, ip: &str, command: &str) -> Output {
        self.ssh_with(user, ip, command, &[], None)
    }

    /// As [`Lab::ssh`], with more `options` and `stdin` fed to the command.
    pub fn ssh_with(
        &self,
        user: &str,
        ip: &str,
        command: &str,
        options: &[String],
        stdin: Option<&str>,
    ) -> Output {
        let mut ssh = self.ssh_command(user, ip, command, options);
        match stdin {
            Some(input) => {
                let mut child = ssh
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("ssh");
                child
                    .stdin
                    .take()
                    .expect("stdin")
                    .write_all(input.as_bytes())
                    .expect("write to ssh");
                child.wait_with_output().expect("ssh")
            }
            None => ssh.stdin(Stdio::null()).output().expect("ssh"),
        }
    }

    /// How far the guest's wall clock is off the host's, and half the
    /// round trip it may be off by: over one ssh session already open,
    /// the guest reads its clock the moment the host asks, so the round
    /// trip is the channel's, not the connection's.
    pub fn guest_clock_offset(&self, user: &str, ip: &str) -> (f64, f64) {
        use std::io::{BufRead, BufReader};
        let unix = || {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("after 1970")
                .as_secs_f64()
        };
        let mut child = self
            .ssh_command(user, ip, "echo ready; read go; date +%s.%N", &[])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("ssh");
        let mut stdin = child.stdin.take().expect("stdin");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let ready = lines.next().and_then(Result::ok).unwrap_or_default();
        assert_eq!(ready, "ready", "the guest's shell never started");
        let before = unix();
        stdin.write_all(b"go\n").expect("write to ssh");
        let said = lines.next().and_then(Result::ok).unwrap_or_default();
        let after = unix();
        let _ = child.wait();
        let guest: f64 = said
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{said:?}: {e}"));
        (guest - (before + after) / 2.0, (after - before) / 2.0)
    }

    /// The ssh command that runs `command` as `user` on `ip`.
    fn ssh_command(&self, user: &str, ip: &str, command: &str, options: &[String]) -> Command {
        let mut ssh = eitri_agent::testkit::tools::tool("ssh");
        ssh.arg("-i").arg(&self.key).args([
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=10",
            "-o",
            "LogLevel=ERROR",
        ]);
        let trusts = options.iter().any(|o| o.starts_with("UserKnownHostsFile"));
        if !trusts {
            ssh.args([
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
            ]);
        }
        for option in options {
            ssh.args(["-o", option]);
        }
        ssh.arg(format!("{user}@{ip}")).arg(command);
        ssh
    }

    /// `command`'s standard output in the guest, failing the test (with
    /// its standard error) when it fails.
    pub fn guest(&self, user: &str, ip: &str, command: &str) -> String {
        let out = self.ssh(user, ip, command);
        assert!(
            out.status.success(),
            "{command:?} as {user} on {ip}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// The pid of the VM's hypervisor, as its pidfile says.
    /// The VM's vsock socket, where its guest agent is reached.
    pub fn guest_socket(&self, id: &str) -> PathBuf {
        let vm = eitri_agent::model::Id::parse(id).expect("an id");
        eitri_agent::state::Layout::new(&self.state())
            .guest_socket(&self.dir.path().join("run"), &vm)
    }

    pub fn hypervisor_pid(&self, id: &str) -> i32 {
        let pidfile = read(&self.state().join("vms").join(id).join("hypervisor.pid"));
        pidfile
            .split_whitespace()
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no pid in {id}'s pidfile: {pidfile:?}"))
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.kill_agent();
        eitri_agent::testkit::end_cgroup_root(&self.cgroup_root);
        let (group, _) = eitri_agent::testkit::test_vmm_ids();
        for device in ["/dev/kvm", "/dev/userfaultfd"] {
            let _ = eitri_agent::provision::jail::acl::revoke_group(Path::new(device), group);
        }
        if std::thread::panicking() && std::env::var_os(KEEP_VAR).is_some() {
            // A panic here would abort the test run: keep nothing if no
            // empty dir can stand in for the one kept.
            if let Ok(empty) = tempfile::tempdir() {
                let kept = std::mem::replace(&mut self.dir, empty);
                eprintln!(
                    "{KEEP_VAR}: the failed lab is kept in {}",
                    kept.keep().display()
                );
            }
        }
    }
}

/// Whether a row says running and ready.
pub fn ready(row: &Value) -> bool {
    row["power_state"] == "running" && row["phase"] == "ready"
}

pub fn row_of(report: &Value, id: &str) -> Value {
    report["report"]["vms"]
        .as_array()
        .and_then(|v| v.iter().find(|r| r["vm_id"] == id))
        .cloned()
        .unwrap_or_default()
}

/// The row's underlay address.
pub fn address(row: &Value) -> String {
    let ip = row["ip"].as_str().unwrap_or_default();
    assert!(ip.parse::<Ipv4Addr>().is_ok(), "no address in {row}");
    ip.to_owned()
}

/// From the VM's hypervisor's start to when `report` was written, both by
/// the agent's clock: for the first report that says something of it.
pub fn since_hypervisor_start(report: &Value, id: &str) -> Duration {
    let written = report["written_at_unix_ms"].as_u64().unwrap_or_default();
    let started = report["details"][id]["pid_since_ms"]
        .as_u64()
        .unwrap_or_default();
    Duration::from_millis(written.saturating_sub(started))
}

/// Prints a figure the way `make e2e-real` collects them.
pub fn timing(what: &str, took: Duration) {
    println!("timing: {what}: {:.1} s", took.as_secs_f64());
}

pub fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Runs `command`, failing the test with its standard error if it fails.
pub fn run(command: &mut Command) -> String {
    let out = command.output().expect("run a program");
    assert!(
        out.status.success(),
        "{command:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn ip(args: &[&str]) {
    eitri_agent::testkit::net::ip(args);
}

/// A network namespace `ns` of its own, joined to the test's by a veth
/// pair (`here` on this side, `eth0` on its side), removed on drop.
pub struct Namespace {
    pub name: String,
    _cleanup: eitri_agent::testkit::net::Namespaces,
}

impl Namespace {
    pub fn new(name: &str, here: &str) -> Namespace {
        ip(&["netns", "add", name]);
        let cleanup = eitri_agent::testkit::net::Namespaces(vec![name.to_owned()]);
        ip(&[
            "link", "add", here, "type", "veth", "peer", "name", "eth0", "netns", name,
        ]);
        ip(&["link", "set", here, "up"]);
        ip(&["-n", name, "link", "set", "lo", "up"]);
        ip(&["-n", name, "link", "set", "eth0", "up"]);
        Namespace {
            name: name.to_owned(),
            _cleanup: cleanup,
        }
    }

    /// Adds `cidr` to its `eth0`.
    pub fn address(&self, cidr: &str) {
        ip(&["-n", &self.name, "addr", "add", cidr, "dev", "eth0"]);
    }

    /// Accepts TCP connections on `at` in this namespace, recording the
    /// address each came from.
    pub fn listen_tcp(&self, at: SocketAddrV4) -> Seen {
        self.watch(move |seen| {
            let listener = std::net::TcpListener::bind(at).expect("listen");
            Box::new(move || {
                for stream in listener.incoming().flatten() {
                    if let Ok(SocketAddr::V4(peer)) = stream.peer_addr() {
                        seen.lock().push((*peer.ip(), String::new()));
                    }
                }
            })
        })
    }

    /// Receives UDP datagrams on `at` in this namespace, recording where
    /// each came from and what it said.
    pub fn listen_udp(&self, at: SocketAddrV4) -> Seen {
        self.watch(move |seen| {
            let socket = std::net::UdpSocket::bind(at).expect("bind");
            Box::new(move || {
                let mut buf = [0u8; 1500];
                while let Ok((n, from)) = socket.recv_from(&mut buf) {
                    if let SocketAddr::V4(from) = from {
                        let said = String::from_utf8_lossy(&buf[..n]).into_owned();
                        seen.lock().push((*from.ip(), said));
                    }
                }
            })
        })
    }

    /// Records the sender address of every ARP frame that reaches this
    /// namespace's `eth0`.
    pub fn capture_arp(&self) -> Seen {
        self.watch(|seen| {
            let socket = eitri_agent::net::packet::PacketSocket::open("eth0", None)
                .expect("a packet socket");
            Box::new(move || {
                let mut frame = [0u8; 1600];
                while let Ok(n) = socket.recv(&mut frame) {
                    // Ethernet (14 bytes), then ARP: its sender address at 14.
                    if n >= 42 && frame[12..14] == [0x08, 0x06] {
                        let sender = Ipv4Addr::new(frame[28], frame[29], frame[30], frame[31]);
                        seen.lock().push((sender, "arp".into()));
                    }
                }
            })
        })
    }

    /// Runs `open` on a thread inside this namespace, then the loop it
    /// returns, for the life of the test process; returns once `open` has.
    fn watch(&self, open: impl FnOnce(Seen) -> Box<dyn FnOnce() + Send> + Send + 'static) -> Seen {
        let seen = Seen::default();
        let (opened_tx, opened_rx) = crossbeam_channel::bounded(1);
        let (ns, record) = (self.name.clone(), seen.clone());
        std::thread::spawn(move || {
            let file = std::fs::File::open(format!("/run/netns/{ns}")).expect("namespace");
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("enter it");
            let serve = open(record);
            let _ = opened_tx.send(());
            serve();
        });
        opened_rx
            .recv_timeout(Duration::from_secs(5))
            .expect("the watcher started");
        seen
    }
}

/// What a watcher of [`Namespace`] saw: where each thing came from, and
/// what it said.
#[derive(Clone, Default)]
pub struct Seen(Arc<Mutex<Vec<(Ipv4Addr, String)>>>);

impl Seen {
    fn lock(&self) -> parking_lot::MutexGuard<'_, Vec<(Ipv4Addr, String)>> {
        self.0.lock()
    }

    pub fn all(&self) -> Vec<(Ipv4Addr, String)> {
        self.0.lock().clone()
    }

    pub fn from(&self, sender: Ipv4Addr) -> Vec<String> {
        self.all()
            .into_iter()
            .filter(|(from, _)| *from == sender)
            .map(|(_, said)| said)
            .collect()
    }
}

/// The site network a VM's second NIC joins: bridge `etsite0` here, and
/// behind it a namespace with the site's DHCP server (dnsmasq at
/// 192.0.2.1, granting 192.0.2.50-60). Start the agent with
/// [`Site::FLAG`].
pub struct Site {
    pub ns: Namespace,
    dnsmasq: Child,
}

impl Site {
    pub const FLAG: &str = "--host-network=site=etsite0";
    pub const SERVER: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);

    pub fn new(lab: &Lab) -> Site {
        ip(&["link", "add", "etsite0", "type", "bridge"]);
        ip(&["link", "set", "etsite0", "up"]);
        let ns = Namespace::new(&format!("etrs{}", std::process::id()), "etssv");
        ip(&["link", "set", "etssv", "master", "etsite0"]);
        ns.address("192.0.2.1/24");
        let leases = lab.dir.path().join("site.leases");
        eitri_agent::testkit::tools::require("dnsmasq");
        let dnsmasq = eitri_agent::testkit::tools::tool("ip")
            .args(["netns", "exec", &ns.name])
            .args([
                "dnsmasq",
                "--no-daemon",
                "--port=0",
                "--interface=eth0",
                "--bind-interfaces",
                "--dhcp-range=192.0.2.50,192.0.2.60,255.255.255.0,1h",
            ])
            .arg(format!("--dhcp-leasefile={}", leases.display()))
            .arg(format!(
                "--pid-file={}",
                lab.dir.path().join("dnsmasq.pid").display()
            ))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("dnsmasq");
        Site { ns, dnsmasq }
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        let _ = self.dnsmasq.kill();
        let _ = self.dnsmasq.wait();
    }
}

/// A namespace beyond the host ("the internet"): 192.0.2.2 and 192.0.2.3
/// on its side of a veth, this side 192.0.2.1 and the default route.
pub fn outside() -> Namespace {
    let ns = Namespace::new(&format!("etro{}", std::process::id()), "etoup");
    ip(&["addr", "add", "192.0.2.1/24", "dev", "etoup"]);
    ip(&["route", "add", "default", "via", "192.0.2.2"]);
    ns.address("192.0.2.2/24");
    ns.address("192.0.2.3/24");
    ns
}

/// An SSH certificate authority (host or user) in the lab's directory.
pub struct Ca {
    key: PathBuf,
}

impl Ca {
    pub fn new(lab: &Lab, name: &str) -> Ca {
        let key = lab.dir.path().join(name);
        run(eitri_agent::testkit::tools::tool("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-C", name, "-f"])
            .arg(&key));
        Ca { key }
    }

    pub fn public(&self) -> String {
        read(&self.key.with_extension("pub")).trim().to_owned()
    }

    /// A certificate for the public key line `public`, for `principals`;
    /// `host` makes it a host certificate.
    pub fn sign(&self, public: &str, principals: &str, host: bool) -> String {
        let dir = self.key.with_extension("signing");
        std::fs::create_dir_all(&dir).expect("a signing dir");
        let subject = dir.join("subject.pub");
        std::fs::write(&subject, format!("{public}\n")).expect("write the key");
        let mut keygen = eitri_agent::testkit::tools::tool("ssh-keygen");
        keygen.arg("-q").arg("-s").arg(&self.key);
        if host {
            keygen.arg("-h");
        }
        run(keygen
            .args(["-I", "eitri-test", "-n", principals])
            .arg(&subject));
        read(&dir.join("subject-cert.pub")).trim().to_owned()
    }
}
