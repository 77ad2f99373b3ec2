//! The second NIC: a site DHCP server (dnsmasq, in its own namespace on a
//! named bridge) grants the guest an address; the agent's snooper learns
//! it, and keeps it across a restart. All inside a network namespace this
//! test unshares, so the host's links are never touched.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use eitri_agent::model::{Id, Mac};
use eitri_agent::net::host::HostNetwork;
use eitri_agent::testkit::net::{ip, private_network, script, udhcpc, underlay_config};

const SECOND_MAC: &str = "02:e1:00:00:00:77";

fn second_mac() -> Mac {
    Mac::parse(SECOND_MAC).expect("a MAC")
}

struct Cleanup {
    namespaces: Vec<String>,
    dnsmasq: Option<Child>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(mut d) = self.dnsmasq.take() {
            let _ = d.kill();
            let _ = d.wait();
        }
        for ns in &self.namespaces {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

fn host_network(state: &std::path::Path) -> HostNetwork {
    HostNetwork::setup(
        underlay_config(),
        state,
        vec![],
        HashMap::from([("site".to_owned(), "etsite".to_owned())]),
    )
    .expect("host network")
}

#[test]
fn the_address_the_site_grants_is_learned_and_survives_a_restart() {
    private_network();
    let tag = format!("{:x}", std::process::id() & 0xffff);
    let (site_ns, guest_ns) = (format!("etdn{tag}"), format!("etgn{tag}"));
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cleanup = Cleanup {
        namespaces: vec![site_ns.clone(), guest_ns.clone()],
        dnsmasq: None,
    };
    // The site: a bridge with a DHCP server behind it.
    ip(&["link", "add", "etsite", "type", "bridge"]);
    ip(&["link", "set", "etsite", "up"]);
    ip(&["netns", "add", &site_ns]);
    ip(&[
        "link", "add", "etdnh", "type", "veth", "peer", "name", "eth0", "netns", &site_ns,
    ]);
    ip(&["link", "set", "etdnh", "master", "etsite"]);
    ip(&["link", "set", "etdnh", "up"]);
    ip(&["-n", &site_ns, "addr", "add", "192.0.2.1/24", "dev", "eth0"]);
    ip(&["-n", &site_ns, "link", "set", "eth0", "up"]);
    eitri_agent::testkit::tools::require("dnsmasq");
    let leases = dir.path().join("dnsmasq.leases");
    cleanup.dnsmasq = Some(
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &site_ns,
                "dnsmasq",
                "--no-daemon",
                "--port=0",
                "--interface=eth0",
                "--bind-interfaces",
            ])
            .arg("--dhcp-range=192.0.2.50,192.0.2.60,255.255.255.0,1h")
            .arg(format!("--dhcp-leasefile={}", leases.display()))
            .arg(format!(
                "--pid-file={}",
                dir.path().join("dnsmasq.pid").display()
            ))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("dnsmasq"),
    );
    // The guest's second NIC: a veth whose host end plays the second tap.
    ip(&["netns", "add", &guest_ns]);
    ip(&[
        "link", "add", "etsnp", "type", "veth", "peer", "name", "eth1", "netns", &guest_ns,
    ]);
    ip(&[
        "-n", &guest_ns, "link", "set", "eth1", "address", SECOND_MAC,
    ]);
    ip(&["-n", &guest_ns, "link", "set", "eth1", "up"]);
    let state = dir.path().join("state");
    let vm = Id::parse("vm-1").expect("id");
    let network = host_network(&state);
    network
        .plug_named(&vm, "site", "etsnp", second_mac())
        .expect("plugged");
    let run = dir.path().join("script.sh");
    let granted = dir.path().join("granted");
    script(
        &run,
        &format!(
            "[ \"$1\" = bound ] && echo \"$ip\" > {}\nexit 0\n",
            granted.display()
        ),
    );

    let dhcp = udhcpc(&guest_ns, "eth1", &run, &[]);
    assert!(
        dhcp.status.success(),
        "the site granted nothing: {}",
        String::from_utf8_lossy(&dhcp.stderr)
    );
    let granted: Ipv4Addr = std::fs::read_to_string(&granted)
        .expect("granted")
        .trim()
        .parse()
        .expect("an address");
    let until = Instant::now() + Duration::from_secs(10);
    while network.network_address(second_mac()) != Some(granted) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    let learned = network.network_address(second_mac());
    drop(network);
    let restarted = host_network(&state);

    assert_eq!(learned, Some(granted));
    assert_eq!(
        restarted.network_address(second_mac()),
        Some(granted),
        "remembered across a restart"
    );
    assert!(
        (50..=60).contains(&granted.octets()[3]),
        "{granted} from the site's pool"
    );
}

#[test]
fn an_unknown_host_network_is_a_permanent_error_naming_the_served_ones() {
    private_network();
    let dir = tempfile::tempdir().expect("tempdir");
    ip(&["link", "add", "etsite", "type", "bridge"]);
    let network = host_network(dir.path());

    let err = network
        .plug_named(
            &Id::parse("vm-1").expect("id"),
            "lab",
            "etnope",
            second_mac(),
        )
        .expect_err("unknown");

    assert!(err.is_permanent());
    assert!(
        err.to_string().contains("\"lab\"") && err.to_string().contains("site"),
        "{err}"
    );
}
