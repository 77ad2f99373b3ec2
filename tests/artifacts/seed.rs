//! The NoCloud seed image, read back by tools that share no code with it:
//! isoinfo (genisoimage), xorriso and blkid.

use std::path::Path;

use eitri_agent::seed::NoCloudSeed;
use eitri_agent::seed::SeedParams;

const SCRIPT: &str = "#!/bin/sh\r\necho 'tenant: \"quoted\" # not yaml'\r\nexit 0\n";

fn params() -> SeedParams {
    SeedParams {
        hostname: "web-1".into(),
        instance_id: "vm-1".into(),
        ssh_authorized_key: "ssh-ed25519 AAAAC3Nz tenant@example".into(),
        user_data: SCRIPT.into(),
        ssh_user_ca_keys: "ssh-ed25519 AAAAca1\nssh-rsa AAAAca2\n".into(),
        ssh_host_key_pem:
            "-----BEGIN OPENSSH PRIVATE KEY-----\nAAAA\n-----END OPENSSH PRIVATE KEY-----\n".into(),
        ssh_host_key_public: "ssh-ed25519 AAAAhost eitri-guest-vm-1".into(),
        ssh_host_cert: "ssh-ed25519-cert-v01@openssh.com AAAAcert".into(),
        mac: "02:11:22:33:44:55".into(),
        network_mac: "02:66:77:88:99:aa".into(),
    }
}

fn built(dir: &Path) -> std::path::PathBuf {
    let iso = dir.join("seed.iso");
    NoCloudSeed::default()
        .build(&iso, &params())
        .expect("seed built")
        .sync()
        .expect("seed synced");
    iso
}

fn run(cmd: &str, args: &[&str], iso: &Path) -> Vec<u8> {
    let out = eitri_agent::testkit::tools::tool(cmd)
        .args(args)
        .arg(iso)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn isoinfo_file(iso: &Path, name: &str) -> Vec<u8> {
    run("isoinfo", &["-J", "-x", name, "-i"], iso)
}

#[test]
fn blkid_sees_an_iso9660_labelled_cidata() {
    let dir = tempfile::tempdir().expect("tempdir");
    let iso = built(dir.path());

    let label = run("blkid", &["-o", "value", "-s", "LABEL"], &iso);
    let kind = run("blkid", &["-o", "value", "-s", "TYPE"], &iso);

    assert_eq!(String::from_utf8_lossy(&label).trim(), "cidata");
    assert_eq!(String::from_utf8_lossy(&kind).trim(), "iso9660");
}

#[test]
fn isoinfo_finds_joliet_and_the_volume_id() {
    let dir = tempfile::tempdir().expect("tempdir");
    let iso = built(dir.path());

    let info = String::from_utf8_lossy(&run("isoinfo", &["-d", "-i"], &iso)).into_owned();

    assert!(info.contains("Volume id: cidata"), "{info}");
    assert!(info.contains("Joliet with UCS level 3 found"), "{info}");
}

#[test]
fn the_lowercase_names_survive() {
    let dir = tempfile::tempdir().expect("tempdir");
    let iso = built(dir.path());

    let listing = String::from_utf8_lossy(&run("isoinfo", &["-J", "-f", "-i"], &iso)).into_owned();

    let mut names: Vec<&str> = listing.lines().collect();
    names.sort();
    assert_eq!(
        names,
        vec![
            "/meta-data",
            "/network-config",
            "/user-data",
            "/vendor-data"
        ]
    );
}

#[test]
fn user_data_is_the_tenants_bytes_exactly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let iso = built(dir.path());

    assert_eq!(isoinfo_file(&iso, "/user-data"), SCRIPT.as_bytes());
}

#[test]
fn meta_data_names_the_instance_and_host() {
    let dir = tempfile::tempdir().expect("tempdir");
    let iso = built(dir.path());

    let meta: serde_json::Value =
        serde_json::from_slice(&isoinfo_file(&iso, "/meta-data")).expect("json is yaml");

    assert_eq!(meta["instance-id"], "vm-1");
    assert_eq!(meta["local-hostname"], "web-1");
}

#[test]
fn vendor_data_carries_the_agents_settings() {
    let dir = tempfile::tempdir().expect("tempdir");
    let iso = built(dir.path());

    let text = String::from_utf8(isoinfo_file(&iso, "/vendor-data")).expect("utf8");
    let body = text
        .strip_prefix("#cloud-config\n")
        .expect("a cloud-config");
    let v: serde_json::Value = serde_json::from_str(body).expect("json is yaml");

    assert_eq!(v["ssh_deletekeys"], false);
    assert_eq!(
        v["ssh_authorized_keys"][0],
        "ssh-ed25519 AAAAC3Nz tenant@example"
    );
    assert_eq!(
        v["ssh_keys"]["ed25519_certificate"],
        "ssh-ed25519-cert-v01@openssh.com AAAAcert"
    );
    assert!(
        v["ssh_keys"]["ed25519_private"]
            .as_str()
            .is_some_and(|k| k.contains("BEGIN OPENSSH PRIVATE KEY"))
    );
    assert_eq!(
        v["write_files"][0]["content"],
        "ssh-ed25519 AAAAca1\nssh-rsa AAAAca2\n"
    );
    assert!(
        v["write_files"][1]["content"]
            .as_str()
            .is_some_and(|c| c.contains("TrustedUserCAKeys"))
    );
}

#[test]
fn network_config_matches_each_nic_by_mac() {
    let dir = tempfile::tempdir().expect("tempdir");
    let iso = built(dir.path());

    let v: serde_json::Value =
        serde_json::from_slice(&isoinfo_file(&iso, "/network-config")).expect("json");

    assert_eq!(v["version"], 2);
    assert_eq!(
        v["ethernets"]["underlay"]["match"]["macaddress"],
        "02:11:22:33:44:55"
    );
    assert_eq!(
        v["ethernets"]["site"]["match"]["macaddress"],
        "02:66:77:88:99:aa"
    );
    assert_eq!(
        v["ethernets"]["site"]["dhcp4-overrides"]["use-routes"],
        false
    );
}

#[test]
fn xorriso_extracts_the_same_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    let iso = built(dir.path());
    let out = dir.path().join("extracted");

    let status = eitri_agent::testkit::tools::tool("xorriso")
        .args(["-osirrox", "on", "-indev"])
        .arg(&iso)
        .args(["-extract", "/"])
        .arg(&out)
        .output()
        .expect("xorriso");

    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    assert_eq!(
        std::fs::read(out.join("user-data")).expect("user-data"),
        SCRIPT.as_bytes()
    );
    assert!(out.join("vendor-data").is_file() && out.join("meta-data").is_file());
}

#[test]
fn a_hostname_with_a_newline_is_refused_and_nothing_written() {
    let dir = tempfile::tempdir().expect("tempdir");
    let iso = dir.path().join("seed.iso");

    let err = NoCloudSeed::default()
        .build(
            &iso,
            &SeedParams {
                hostname: "web\nbootcmd: [x]".into(),
                ..params()
            },
        )
        .expect_err("refused");

    assert!(err.is_permanent());
    assert!(!iso.exists());
}

#[test]
fn a_large_user_data_spans_sectors_intact() {
    let dir = tempfile::tempdir().expect("tempdir");
    let iso = dir.path().join("seed.iso");
    let big: String = (0..200_000)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();

    NoCloudSeed::default()
        .build(
            &iso,
            &SeedParams {
                user_data: big.clone(),
                ..params()
            },
        )
        .expect("built")
        .sync()
        .expect("synced");

    assert_eq!(isoinfo_file(&iso, "/user-data"), big.as_bytes());
}
