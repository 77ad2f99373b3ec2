//! Booted VMs on the host's network: each agent's firewall tables and
//! bridge its own, a tap gone under an adopted VM, and egress rules held
//! with the VMM untouched.

use super::*;

/// An agent over `dir` with guest networking on `bridge`, `subnet` and
/// taps `prefix…`, its claim recorded in `registry`.
fn networked(dir: &Path, registry: &str, (bridge, subnet, prefix): (&str, &str, &str)) -> Agent {
    std::fs::create_dir_all(dir).expect("dir");
    desired(dir, ONE_VOLUME);
    Agent::start(
        dir,
        &[
            "--agents-dir",
            registry,
            "--underlay-bridge",
            bridge,
            "--underlay-subnet",
            subnet,
            "--tap-prefix",
            prefix,
        ],
    )
}

/// A host of the test's own: a network namespace, a temp dir, and the
/// agents' registry in it.
struct NetHost {
    dir: tempfile::TempDir,
    registry: String,
}

impl NetHost {
    fn new() -> NetHost {
        eitri_agent::testkit::net::private_network();
        let dir = tempfile::tempdir().expect("tempdir");
        let registry = dir.path().join("agents").display().to_string();
        NetHost { dir, registry }
    }

    /// An agent over the dir `name` with guest networking on `network`.
    fn agent(&self, name: &str, network: (&str, &str, &str)) -> Agent {
        networked(&self.dir.path().join(name), &self.registry, network)
    }

    /// `eitri-agent release --force` of a stopped agent's state dir, as
    /// an operator runs it: from a shell, with ip and nft on PATH.
    fn release(&self, agent: &Agent) {
        let out = Command::new(BIN)
            .args(["release", "--state-dir"])
            .arg(&agent.state)
            .args(["--agents-dir", &self.registry, "--force"])
            .output()
            .expect("release");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The name of the agent's firewall tables, as its claim records it.
fn tables_of(agent: &Agent) -> String {
    let text = std::fs::read(agent.state.join("jail/claim.json")).expect("claim");
    let claim: serde_json::Value = serde_json::from_slice(&text).expect("json");
    claim["network"]["table"]
        .as_str()
        .expect("table")
        .to_owned()
}

/// What `nft` lists of one of the agent's ip tables ("" when none).
fn ip_table(name: &str) -> String {
    eitri_agent::testkit::net::nft_table("ip", name).unwrap_or_default()
}

#[test]
fn a_second_agents_start_leaves_the_first_agents_firewall_tables_alone() {
    let host = NetHost::new();
    let a = host.agent("one", ("etbina", "100.77.0.0/16", "etba"));
    a.wait_report("the first agent", |r| volumes(r).len() == 1);

    let b = host.agent("two", ("etbinb", "100.78.0.0/16", "etbb"));
    b.wait_report("the second agent", |r| volumes(r).len() == 1);

    let (table_a, table_b) = (tables_of(&a), tables_of(&b));
    assert_ne!(table_a, table_b);
    let (rules_a, rules_b) = (ip_table(&table_a), ip_table(&table_b));
    assert!(
        rules_a.contains("\"etbina\"") && !rules_a.contains("etbinb"),
        "{rules_a}"
    );
    assert!(rules_b.contains("\"etbinb\""), "{rules_b}");
}

#[test]
fn a_released_state_dir_leaves_no_bridge_and_no_firewall_table() {
    let host = NetHost::new();
    let mut agent = host.agent("one", ("etbinr", "100.77.0.0/16", "etbr"));
    agent.wait_report("the agent", |r| volumes(r).len() == 1);
    let table = tables_of(&agent);
    assert!(agent.stop(Signal::SIGTERM).success());
    assert!(!ip_table(&table).is_empty(), "the agent made its table");

    host.release(&agent);
    assert_eq!(ip_table(&table), "", "its ip table is left");
    let bridge = eitri_agent::testkit::tools::tool("ip")
        .args(["link", "show", "dev", "etbinr"])
        .output()
        .expect("ip");
    assert!(!bridge.status.success(), "its bridge is left");
}

#[test]
fn a_stale_bridge_holding_the_guests_subnet_is_named_at_start() {
    let host = NetHost::new();
    let ip = eitri_agent::testkit::net::ip;
    ip(&["link", "add", "etbstale", "type", "bridge"]);
    ip(&["addr", "add", "100.77.0.1/16", "dev", "etbstale"]);
    ip(&["link", "set", "etbstale", "up"]);

    let agent = host.agent("one", ("etbinq", "100.77.0.0/16", "etbq"));

    let report = agent.wait_report("the agent", |r| volumes(r).len() == 1);
    let notes = report["notes"].to_string();
    assert!(
        notes.contains("link etbstale holds 100.77.0.1/16, in the guests' subnet 100.77.0.0/16"),
        "{notes}"
    );
}

const IP_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";

/// An agent's start and release in this test's network namespace, whose
/// IPv4 forwarding is `before`; what forwarding is while it runs and
/// after its release.
fn forwarding_around_an_agent(before: &str) -> (String, String) {
    let host = NetHost::new();
    std::fs::write(IP_FORWARD, before).expect("set forwarding");
    let mut agent = host.agent("one", ("etbinf", "100.77.0.0/16", "etbf"));
    agent.wait_report("the agent", |r| volumes(r).len() == 1);
    let running = std::fs::read_to_string(IP_FORWARD).expect("forwarding");
    assert!(agent.stop(Signal::SIGTERM).success());

    host.release(&agent);
    let after = std::fs::read_to_string(IP_FORWARD).expect("forwarding");
    (running.trim().to_owned(), after.trim().to_owned())
}

#[test]
fn release_turns_off_the_forwarding_the_agent_turned_on() {
    let (running, after) = forwarding_around_an_agent("0");

    assert_eq!((running.as_str(), after.as_str()), ("1", "0"));
}

#[test]
fn release_leaves_on_the_forwarding_the_host_had() {
    let (running, after) = forwarding_around_an_agent("1");

    assert_eq!((running.as_str(), after.as_str()), ("1", "1"));
}

#[test]
fn a_second_agent_on_the_first_agents_bridge_stops_naming_the_first() {
    let host = NetHost::new();
    let a = host.agent("one", ("etbina", "100.77.0.0/16", "etba"));
    a.wait_report("the first agent", |r| volumes(r).len() == 1);
    let rules_before = ip_table(&tables_of(&a));

    let mut b = host.agent("two", ("etbina", "100.78.0.0/16", "etbb"));

    let status = b.child.take().expect("child").wait().expect("exit");
    assert_eq!(status.code(), Some(1));
    let log = b.log_text();
    assert!(
        log.contains("bridge etbina")
            && log.contains("--underlay-bridge")
            && log.contains(&a.state.display().to_string()),
        "{log}"
    );
    assert!(rules_before.contains("\"etbina\""), "{rules_before}");
    assert_eq!(ip_table(&tables_of(&a)), rules_before);
}

#[test]
fn an_adopted_vm_whose_tap_is_gone_is_not_ready_and_says_why() {
    eitri_agent::testkit::net::private_network();
    let dir = tempfile::tempdir().expect("tempdir");
    let boot = Booting::new(dir.path());
    desired(
        dir.path(),
        &format!(r#"{{"vms":[{}]}}"#, boot.vm_json("cut-1", "")),
    );
    let network = ["--underlay-bridge", "etbinbr0"];
    let mut first = boot.start(dir.path(), &network);
    first.wait_report("cut-1 ready", |r| row_of(r, "cut-1")["phase"] == "ready");
    first.stop(Signal::SIGKILL);
    let taps = eitri_agent::testkit::tools::tool("ip")
        .args(["-o", "link", "show", "master", "etbinbr0"])
        .output()
        .expect("ip link");
    let tap = String::from_utf8_lossy(&taps.stdout)
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|name| name.split('@').next().unwrap_or(name).to_owned())
        .find(|name| name.starts_with("etbin"))
        .expect("the VM's tap on the bridge");
    let deleted = eitri_agent::testkit::tools::tool("ip")
        .args(["link", "del", &tap])
        .status()
        .expect("ip link del");
    assert!(deleted.success());

    let second = boot.start(dir.path(), &network);
    let report = second.wait_report("cut-1 said to be cut off", |r| {
        row_of(r, "cut-1")["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("not served"))
    });

    let row = row_of(&report, "cut-1");
    assert_eq!(row["phase"], "failed", "{row}");
    assert_eq!(row["power_state"], "running", "{row}");
    assert!(
        row["last_error"].as_str().is_some_and(|e| e.contains(&tap)),
        "{row}"
    );
}

#[test]
fn a_running_vms_egress_change_is_held_by_the_binary_with_its_vmm_untouched() {
    eitri_agent::testkit::net::private_network();
    let dir = tempfile::tempdir().expect("tempdir");
    let boot = Booting::new(dir.path());
    let wanted = |deny: &str| {
        let extra = format!(r#","egress_deny":["{deny}"]"#);
        format!(r#"{{"vms":[{}]}}"#, boot.vm_json("web-1", &extra))
    };
    desired(dir.path(), &wanted("203.0.113.10/32"));
    let agent = boot.start(dir.path(), &["--underlay-bridge", "etbinbr0"]);
    agent.wait_report("web-1 ready", |r| {
        let row = row_of(r, "web-1");
        row["phase"] == "ready" && row["egress"] == "deny 203.0.113.10/32"
    });
    let (pid, before) = (
        vmm_pid(&boot, "web-1"),
        eitri_agent::testkit::net::nft_set_elements("vm_deny"),
    );

    desired(dir.path(), &wanted("203.0.113.20/32"));
    agent.wait_report("the new list held", |r| {
        row_of(r, "web-1")["egress"] == "deny 203.0.113.20/32"
    });

    let after = eitri_agent::testkit::net::nft_set_elements("vm_deny");
    assert!(before.contains("203.0.113.10"), "{before}");
    assert!(
        after.contains("203.0.113.20") && !after.contains("203.0.113.10"),
        "{after}"
    );
    assert!(pid.is_some());
    assert_eq!(vmm_pid(&boot, "web-1"), pid);
}
