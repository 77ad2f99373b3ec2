//! An interface's MAC and its up flag, changed through the kernel's
//! ioctls (what a clone's guest agent gives its NICs), on a veth pair in
//! a network namespace the test unshares.

// Linux only: it drives Linux-only parts (namespaces, ioctls on links).
#![cfg(target_os = "linux")]

use eitri_agent::net::packet::{interface_mac, set_interface_mac, set_interface_up};
use eitri_agent::testkit::net::{ip, private_network};

const LINK: &str = "eitri-dm0";

fn link_flags() -> String {
    let out = std::process::Command::new("ip")
        .args(["-o", "link", "show", "dev", LINK])
        .output()
        .expect("ip runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.split(['<', '>']).nth(1).unwrap_or_default().to_owned()
}

#[test]
fn an_interface_that_is_up_is_given_a_new_mac() {
    private_network();
    ip(&[
        "link",
        "add",
        LINK,
        "address",
        "02:e1:00:00:00:01",
        "type",
        "veth",
        "peer",
        "name",
        "eitri-dm1",
    ]);
    ip(&["link", "set", LINK, "up"]);
    let new = [0x02, 0xe1, 0, 0, 0, 0x42];

    set_interface_mac(LINK, new).expect("the MAC is changed");

    assert_eq!(interface_mac(LINK).expect("read back"), new);
}

#[test]
fn an_interface_is_taken_down_and_brought_up_with_its_other_flags_kept() {
    private_network();
    ip(&[
        "link",
        "add",
        LINK,
        "type",
        "veth",
        "peer",
        "name",
        "eitri-dm1",
    ]);
    ip(&["link", "set", LINK, "arp", "off", "up"]);

    set_interface_up(LINK, false).expect("taken down");
    let down = link_flags();
    set_interface_up(LINK, true).expect("brought up");
    let up = link_flags();

    assert!(
        !down.split(',').any(|f| f == "UP"),
        "flags when down: {down}"
    );
    assert!(up.split(',').any(|f| f == "UP"), "flags when up: {up}");
    assert!(up.split(',').any(|f| f == "NOARP"), "NOARP kept: {up}");
}
