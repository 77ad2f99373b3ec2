//! A VM's network: taps, the bridge, the port guard and egress rules, across restarts.

use super::*;

/// Deletes a test link on the way out, whatever happened.
pub(crate) struct Link(String);

impl Drop for Link {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.0])
            .output();
    }
}

#[test]
fn a_leaked_tap_with_the_agents_prefix_is_removed_at_start() {
    let h = Host::new(&[]);
    // A persistent tap, as `ip tuntap add` (or another agent's bug) leaves.
    let leaked = Link(format!("{}leak", tap_prefix()));
    let made = std::process::Command::new("ip")
        .args(["tuntap", "add", "dev", &leaked.0, "mode", "tap"])
        .status()
        .expect("ip");
    assert!(made.success());
    assert!(link_exists(&leaked.0));

    let restarted = CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone());
    restarted.recover(&known(&h.store));

    assert!(!link_exists(&leaked.0), "{} was not removed", leaked.0);
}

#[test]
fn a_tap_a_live_vmm_holds_survives_a_restart() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let tap = h.backend.taps(&id("vm-1")).expect("taps").underlay;

    let restarted = CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone());
    // vm-1 has no record; the last desired state names it.
    restarted.recover(&[id("vm-1")]);

    assert!(link_exists(&tap));
    assert!(h.backend.running(&id("vm-1")));
}

#[test]
fn a_booted_vm_has_its_address_and_its_tap_on_the_bridge_until_destroyed() {
    // A network namespace of this test's own: the bridge and NAT table
    // never touch the host's.
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    let subnet = eitri_agent::testkit::net::underlay_config().subnet;
    let spec = h.spec("vm-1");

    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let address = h.backend.address(&id("vm-1"));
    let port = std::process::Command::new("ip")
        .args([
            "-d",
            "link",
            "show",
            &h.backend.taps(&id("vm-1")).expect("taps").underlay,
        ])
        .output()
        .expect("ip");
    h.backend
        .destroy(&id("vm-1"), Deadline::NONE)
        .expect("destroy");

    let ip: Ipv4Addr = address.expect("an address right after boot");
    assert!(subnet.contains(ip) && ip != subnet.gateway(), "{ip}");
    let port = String::from_utf8_lossy(&port.stdout);
    assert!(
        port.contains("master etbr0") && port.contains("isolated on"),
        "{port}"
    );
    assert_eq!(h.backend.address(&id("vm-1")), None, "released at destroy");
}

#[test]
fn after_a_vmm_crash_an_agent_crash_and_a_destroy_no_link_with_the_prefix_remains() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot vm-1");
    h.backend
        .boot(&h.spec("vm-2"), Deadline::NONE)
        .expect("boot vm-2");
    let crashed = h.pid("vm-1").expect("pid");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(crashed),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill -9");
    wait_until("the VMM to die", || !alive(crashed));

    // The agent "crashes": a new backend over the same state, then the
    // control plane deletes what is left.
    let restarted = CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone());
    restarted
        .destroy(&id("vm-1"), Deadline::NONE)
        .expect("destroy vm-1");
    restarted
        .destroy(&id("vm-2"), Deadline::NONE)
        .expect("destroy vm-2");

    let links = String::from_utf8_lossy(
        &std::process::Command::new("ip")
            .args(["-o", "link", "show"])
            .output()
            .expect("ip")
            .stdout,
    )
    .into_owned();
    let ours: Vec<&str> = links
        .lines()
        .filter(|l| l.contains(&format!(": {}", tap_prefix())))
        .collect();
    assert!(ours.is_empty(), "{ours:?}");
}

#[test]
fn an_agent_restart_serves_the_adopted_vms_network_again() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    h.tick(&h.vm("vm-1"));
    let address = h.backend.address(&id("vm-1"));
    assert!(address.is_some());

    // The agent restarts: its responders died with it; the VMM did not.
    h.cfg.network = None;
    h.backend = Arc::new(CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone()));
    let network = Arc::new(
        eitri_agent::net::host::HostNetwork::setup(
            underlay(),
            h.store.layout(),
            vec![],
            std::collections::HashMap::new(),
        )
        .expect("network"),
    );
    h.cfg.network = Some(Arc::clone(&network));
    let restarted = CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone());
    restarted.recover(&known(&h.store));

    assert!(network.serves_dhcp(&id("vm-1")));
    assert_eq!(restarted.address(&id("vm-1")), address);
    assert!(restarted.running(&id("vm-1")));
}

#[test]
fn a_vm_whose_tap_cannot_join_its_network_fails_and_leaves_no_hypervisor() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    // A named network whose bridge is gone: the second tap's join fails,
    // on the plug's own thread, while the VMM starts.
    let network = eitri_agent::net::host::HostNetwork::setup(
        underlay(),
        h.store.layout(),
        vec![],
        std::collections::HashMap::from([("site".to_owned(), "etnobridge".to_owned())]),
    )
    .expect("network");
    h.cfg.network = Some(Arc::new(network));
    h.backend = Arc::new(CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone()));
    let mut spec = h.spec("vm-1");
    spec.network = "site".into();

    let err = h
        .backend
        .boot(&spec, Deadline::NONE)
        .expect_err("no bridge");

    assert!(err.to_string().contains("etnobridge"), "{err}");
    let pid = h.pid("vm-1").expect("a VMM was started");
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the VMM of a failed plug still runs"
    );
    assert!(!h.backend.running(&id("vm-1")));
}

#[test]
fn with_networking_off_a_vm_gets_no_nic() {
    let h = Host::new(&[]);

    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");

    let pid = h.pid("vm-1").expect("pid");
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    assert!(!args.iter().any(|a| a == "--net"), "{args:?}");
    assert_eq!(h.backend.taps(&id("vm-1")), None);
}

#[test]
fn a_destroyed_vm_leaves_no_rule_naming_its_tap() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");
    let tap = h.backend.taps(&id("vm-1")).expect("taps").underlay;
    assert!(
        nft_ruleset().contains(&format!("\"{tap}\" . ")),
        "guarded while it runs"
    );

    h.backend
        .destroy(&id("vm-1"), Deadline::NONE)
        .expect("destroy");

    let rules = nft_ruleset();
    assert!(!rules.contains(&tap), "{rules}");
}

#[test]
fn an_adopted_vm_is_guarded_again_before_its_first_tick() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    h.tick(&h.vm("vm-1"));
    let tap = h.backend.taps(&id("vm-1")).expect("taps").underlay;
    let mac = eitri_agent::model::Mac::underlay(&id("vm-1")).to_string();
    let element = format!("\"{tap}\" . {mac}");

    // The agent restarts: setting the network up again replaces its tables
    // (the adopted tap is dropped whole meanwhile), and recovery guards it.
    let mut cfg = h.cfg.clone();
    cfg.network = Some(Arc::new(
        eitri_agent::net::host::HostNetwork::setup(
            underlay(),
            h.store.layout(),
            vec![],
            std::collections::HashMap::new(),
        )
        .expect("network"),
    ));
    let between = nft_ruleset();
    let restarted = CloudHypervisor::new(Arc::clone(&h.store), cfg);
    restarted.recover(&known(&h.store));

    let after = nft_ruleset();
    assert!(!between.contains(&element), "{between}");
    assert!(
        between.contains(&format!("iifname != \"{}*\" accept", tap_prefix()))
            && between.contains("iifname . ether saddr != @macs"),
        "an unguarded tap of the agent's is dropped: {between}"
    );
    assert!(after.contains(&element), "{after}");
}

/// `vm`'s desired state with its own egress rules.
pub(crate) fn with_egress(h: &Host, vm: &str, epoch: u64, deny: &str, allow: &str) -> Snapshot {
    let mut d = h.desired(vm);
    d.egress = eitri_agent::model::Egress {
        deny: eitri_agent::model::Cidr::parse_list(deny).expect("deny"),
        allow: eitri_agent::model::Cidr::parse_list(allow).expect("allow"),
    };
    snapshot(epoch, vec![present(d)])
}

#[test]
fn a_running_vms_egress_change_is_held_within_a_tick_with_its_vmm_untouched() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    h.tick(&with_egress(&h, "vm-1", 1, "203.0.113.10", ""));
    let (pid, ip) = (h.pid("vm-1"), h.backend.address(&id("vm-1")).expect("ip"));
    let before = nft_set_elements("vm_deny");

    h.tick(&with_egress(&h, "vm-1", 2, "203.0.113.20", ""));

    let after = nft_set_elements("vm_deny");
    assert!(before.contains(&format!("{ip} . 203.0.113.10")), "{before}");
    assert!(
        after.contains(&format!("{ip} . 203.0.113.20")) && !after.contains("203.0.113.10"),
        "{after}"
    );
    assert_eq!(h.pid("vm-1"), pid);
    assert!(pid.is_some_and(alive));
    assert_eq!(h.row("vm-1").egress, "deny 203.0.113.20/32");
}

#[test]
fn an_adopted_vm_is_held_to_its_recorded_egress_rules_before_its_first_tick() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    h.tick(&with_egress(&h, "vm-1", 1, "0.0.0.0/0", "192.0.2.0/24"));
    let ip = h.backend.address(&id("vm-1")).expect("ip");

    // The agent restarts: its tables are made afresh, then recovery.
    let mut cfg = h.cfg.clone();
    cfg.network = Some(Arc::new(
        eitri_agent::net::host::HostNetwork::setup(
            underlay(),
            h.store.layout(),
            vec![],
            std::collections::HashMap::new(),
        )
        .expect("network"),
    ));
    let between = nft_set_elements("vm_deny");
    let restarted = CloudHypervisor::new(Arc::clone(&h.store), cfg);
    restarted.recover(&known(&h.store));

    assert!(!between.contains(&ip.to_string()), "{between}");
    assert!(
        nft_set_elements("vm_deny").contains(&format!("{ip} . 0.0.0.0/0")),
        "{}",
        nft_ruleset()
    );
    assert!(nft_set_elements("vm_allow").contains(&format!("{ip} . 192.0.2.0/24")));
}

#[test]
fn a_destroyed_vm_leaves_no_egress_rule_of_its_own() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    h.tick(&with_egress(&h, "vm-1", 1, "0.0.0.0/0", "192.0.2.0/24"));
    let ip = h.backend.address(&id("vm-1")).expect("ip").to_string();
    let held = nft_set_elements("vm_deny");

    // Through the engine, as a deleted VM goes: a destroy behind its back
    // would race its worker booting the VM it still wants.
    h.tick(&snapshot(2, vec![tombstoned("vm-1")]));

    assert!(held.contains(&ip), "{held}");
    assert!(!h.store.layout().vm_dir(&id("vm-1")).exists());
    assert!(!nft_set_elements("vm_deny").contains(&ip));
    assert!(!nft_set_elements("vm_allow").contains(&ip));
}

/// The VMs named in the state dir's VMM ids.
fn holding_vmm_ids(h: &Host) -> Vec<String> {
    let ids: std::collections::BTreeMap<String, u32> =
        serde_json::from_slice(&std::fs::read(h.store.layout().vmm_ids()).expect("the VMM ids"))
            .expect("a map of VMM ids");
    ids.into_keys().collect()
}

#[test]
fn leases_held_with_no_record_and_no_vmm_are_given_back_at_start() {
    // A create takes its leases beside its attempt's save: a crash between
    // the two leaves them held by a VM with no record.
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    h.backend
        .reserve(&h.spec("vm-1"))
        .expect("reserve")
        .sync()
        .expect("durable");
    assert!(h.backend.address(&id("vm-1")).is_some());
    assert_eq!(holding_vmm_ids(&h), ["vm-1"]);

    let restarted = CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone());
    // The last desired state still names vm-1: what holds is its record.
    restarted.recover(&[id("vm-1")]);

    assert_eq!(restarted.address(&id("vm-1")), None);
    assert!(holding_vmm_ids(&h).is_empty(), "{:?}", holding_vmm_ids(&h));
}

#[test]
fn leases_of_a_recorded_vm_with_no_vmm_are_kept_at_start() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    let spec = h.spec("vm-1");
    h.store
        .save(&eitri_agent::state::Record::new(spec.clone()))
        .expect("save");
    h.backend
        .reserve(&spec)
        .expect("reserve")
        .sync()
        .expect("durable");
    let address = h.backend.address(&id("vm-1"));

    let restarted = CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone());
    restarted.recover(&known(&h.store));

    assert!(address.is_some());
    assert_eq!(restarted.address(&id("vm-1")), address);
    assert_eq!(holding_vmm_ids(&h), ["vm-1"]);
}
