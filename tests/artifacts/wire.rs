//! Wire ⇄ domain conversion: every field survives the round trip, and
//! everything from the wire is validated before it can name a path.

use eitri_agent::model::{
    Id, Limits, Phase, PowerState, QuarantinedVm, Report, VmStatus, VolumeState, VolumeStatus,
    WantedVm, WantedVolume,
};
use eitri_agent::pb::{self, convert};
use std::sync::Arc;

/// A wire VM with every field set to a distinct, valid value.
fn full_vm(id: &str) -> pb::VmSpec {
    pb::VmSpec {
        vm_id: id.into(),
        name: "web-1.example".into(),
        image_url: "http://mirror.test/base.raw".into(),
        image_sha256: "0123456789abcdef".repeat(4),
        cloud_init: "#!/bin/sh\necho hi\n".into(),
        ssh_authorized_key: "ssh-ed25519 AAAAkey user@test".into(),
        network: "lan".into(),
        volume_ids: vec!["vol-a".into(), "vol-b".into()],
        vcpus: 4,
        mem_mb: 2048,
        disk_gb: 20,
        power_state: "stopped".into(),
        tombstoned: false,
        host_cert_required: true,
        ssh_host_cert: "ssh-ed25519-cert-v01@openssh.com AAAAcert".into(),
        ssh_user_ca_authorized_keys: vec!["ssh-ed25519 AAAAca1".into(), "ssh-rsa AAAAca2".into()],
        egress_allow: vec!["10.1.0.0/16".into(), "192.0.2.7/32".into()],
        egress_deny: vec!["0.0.0.0/0".into()],
        cpu_max_millis: 2500,
        cpu_burst_ms: 50,
        disk_mbps: 200,
        disk_iops: 5000,
        net_mbps: 1000,
        readiness: Some(pb::Readiness {
            tcp_port: 22,
            period_s: 5,
            timeout_ms: 800,
            grace_s: 90,
            restart_after_s: 120,
            ..pb::Readiness::default()
        }),
        published_ports: vec![pb::PublishedPort {
            protocol: "udp".into(),
            host_port: 30053,
            guest_port: 53,
            host_address: "192.0.2.1".into(),
        }],
        wake_on_traffic: true,
        idle_suspend_after_s: 300,
        on_panic: "reboot".into(),
        template: false,
        clone_of: String::new(),
    }
}

fn full_snapshot() -> pb::Snapshot {
    pb::Snapshot {
        epoch: 17,
        min_agent_version: "1.2.0".into(),
        vms: vec![
            full_vm("vm-1"),
            pb::VmSpec {
                vm_id: "vm-gone".into(),
                tombstoned: true,
                ..Default::default()
            },
        ],
        volumes: vec![
            pb::VolumeSpec {
                volume_id: "vol-a".into(),
                size_gb: 10,
                tombstoned: false,
            },
            pb::VolumeSpec {
                volume_id: "vol-old".into(),
                size_gb: 0,
                tombstoned: true,
            },
        ],
        // Checked by the source (signed snapshots), not carried further.
        ..pb::Snapshot::default()
    }
}

fn only_vm(raw: pb::VmSpec) -> eitri_agent::model::Snapshot {
    convert::snapshot_from_wire(&pb::Snapshot {
        vms: vec![raw],
        ..Default::default()
    })
}

fn rejection(raw: pb::VmSpec) -> String {
    let snap = only_vm(raw);
    assert!(
        snap.vms.is_empty(),
        "expected a rejection, got {:?}",
        snap.vms
    );
    snap.rejected_vms[0].error.to_string()
}

#[test]
fn snapshot_round_trips_every_field() {
    let wire = full_snapshot();

    let back = convert::snapshot_to_wire(&convert::snapshot_from_wire(&wire));

    assert_eq!(back, wire);
}

#[test]
fn snapshot_fields_land_in_the_domain() {
    let snap = convert::snapshot_from_wire(&full_snapshot());

    let WantedVm::Present(d) = &snap.vms[0] else {
        panic!("vm-1 should be present")
    };
    assert_eq!(d.power, PowerState::Stopped);
    assert_eq!(d.spec.vcpus, 4);
    assert_eq!(
        d.spec.volume_ids,
        vec![Id::parse("vol-a").unwrap(), Id::parse("vol-b").unwrap()]
    );
    assert_eq!(
        snap.vms[1],
        WantedVm::Tombstoned(Id::parse("vm-gone").unwrap())
    );
    assert_eq!(
        snap.volumes[1],
        WantedVolume::Tombstoned(Id::parse("vol-old").unwrap())
    );
}

#[test]
fn report_round_trips_every_field() {
    let report = Report {
        last_seen_epoch: 9,
        vms: vec![
            Arc::new(VmStatus {
                vm_id: "vm-1".into(),
                ip: "10.0.0.2".into(),
                network_ip: "192.0.2.7".into(),
                power: Some(PowerState::Running),
                phase: Some(Phase::Ready),
                last_error: "old error".into(),
                status_detail: "booting".into(),
                ssh_host_pubkey: "ssh-ed25519 AAAAhost".into(),
                egress: "deny 0.0.0.0/0 except 10.1.0.0/16".into(),
                limits: "cpu 1.5, net 100 Mbit/s each way".into(),
                readiness: "tcp 22 answered".into(),
                spec_rejected: "egress_allow: not a range".into(),
                published: vec![eitri_agent::model::Publish {
                    transport: eitri_agent::model::Transport::Tcp,
                    host_port: 30080,
                    guest_port: 80,
                    host_address: None,
                }],
                asleep: true,
                last_wake: "woken 3 s ago by tcp from 192.0.2.9:40312 to port 30080".into(),
                guest: "system up (systemd: running), up 3 min".into(),
                guest_memory: Some(eitri_agent::model::GuestMemory {
                    total_kib: 512 << 10,
                    available_kib: 400 << 10,
                }),
            }),
            Arc::new(VmStatus {
                vm_id: "vm-2".into(),
                power: None,
                phase: Some(Phase::Failed),
                ..Default::default()
            }),
        ]
        .into(),
        quarantined: vec![QuarantinedVm {
            vm_id: Id::parse("vm-q").unwrap(),
            name: "q".into(),
            vmspec_json: br#"{"vm_id":"vm-q"}"#.to_vec(),
            destroy_at_unix: 1_700_000_000,
        }],
        destroyed: vec![Id::parse("vm-d").unwrap()],
        volumes: vec![VolumeStatus {
            volume_id: "vol-a".into(),
            state: VolumeState::Tombstoned,
            size_gb: 10,
            last_error: "still attached to vm-1".into(),
        }],
        fence_violation: true,
    };

    let back = convert::report_from_wire(&convert::report_to_wire(&report)).expect("valid");

    assert_eq!(back, report);
}

#[test]
fn no_observation_is_an_empty_power_string() {
    let wire = convert::report_to_wire(&Report {
        vms: vec![Arc::new(VmStatus {
            vm_id: "vm-1".into(),
            power: None,
            ..Default::default()
        })]
        .into(),
        ..Default::default()
    });

    assert_eq!(wire.vms[0].power_state, "");
}

#[test]
fn snapshot_json_uses_the_proto_field_names_and_may_omit_the_epoch() {
    let json = r#"{"vms":[{"vm_id":"vm-1","name":"a","image_url":"file:///img","image_sha256":"00000000000000000000000000000000000000000000000000000000000000ff","vcpus":1,"mem_mb":128,"disk_gb":1,"power_state":"running"}]}"#;

    let wire: pb::Snapshot = serde_json::from_str(json).expect("json");

    let snap = convert::snapshot_from_wire(&wire);
    assert_eq!(snap.epoch, 0);
    assert_eq!(snap.vms.len(), 1, "rejected: {:?}", snap.rejected_vms);
}

#[test]
fn bad_ids_are_refused_with_no_id_claimed() {
    for raw in ["../x", "a/b", "..", "", &"x".repeat(65)] {
        let snap = only_vm(pb::VmSpec {
            vm_id: raw.to_string(),
            ..full_vm("ignored")
        });

        assert!(snap.vms.is_empty(), "{raw:?} accepted");
        assert_eq!(snap.rejected_vms[0].id, None, "{raw:?}");
    }
}

#[test]
fn a_bad_field_still_claims_a_valid_id() {
    let snap = only_vm(pb::VmSpec {
        vcpus: 0,
        ..full_vm("vm-1")
    });

    assert_eq!(snap.rejected_vms[0].id, Some(Id::parse("vm-1").unwrap()));
}

#[test]
fn sizes_must_be_positive_and_bounded() {
    let cases = [
        pb::VmSpec {
            vcpus: 0,
            ..full_vm("v")
        },
        pb::VmSpec {
            vcpus: 513,
            ..full_vm("v")
        },
        pb::VmSpec {
            mem_mb: -1,
            ..full_vm("v")
        },
        pb::VmSpec {
            disk_gb: 0,
            ..full_vm("v")
        },
        pb::VmSpec {
            disk_gb: 1 << 40,
            ..full_vm("v")
        },
    ];
    for raw in cases {
        let err = rejection(raw.clone());
        assert!(err.contains("outside 1..="), "{raw:?}: {err}");
    }
}

#[test]
fn sha256_must_be_64_hex() {
    let err = rejection(pb::VmSpec {
        image_sha256: "abc".into(),
        ..full_vm("v")
    });

    assert!(err.contains("image_sha256"), "{err}");
}

#[test]
fn sha256_is_normalised_to_lowercase() {
    let snap = only_vm(pb::VmSpec {
        image_sha256: "AB".repeat(32),
        ..full_vm("v")
    });

    let WantedVm::Present(d) = &snap.vms[0] else {
        panic!("rejected")
    };
    assert_eq!(d.spec.image_sha256, "ab".repeat(32));
}

#[test]
fn unknown_power_state_is_refused() {
    let err = rejection(pb::VmSpec {
        power_state: "paused".into(),
        ..full_vm("v")
    });

    assert!(
        err.contains("power_state") && err.contains("paused"),
        "{err}"
    );
}

#[test]
fn hostname_with_a_newline_is_refused() {
    let err = rejection(pb::VmSpec {
        name: "web\nruncmd: [evil]".into(),
        ..full_vm("v")
    });

    assert!(err.contains("invalid name"), "{err}");
}

#[test]
fn unsupported_url_scheme_is_refused() {
    let err = rejection(pb::VmSpec {
        image_url: "ftp://mirror/base.raw".into(),
        ..full_vm("v")
    });

    assert!(err.contains("image_url"), "{err}");
}

#[test]
fn multi_line_key_is_refused() {
    let err = rejection(pb::VmSpec {
        ssh_authorized_key: "ssh-ed25519 AAAA\nssh-rsa BBBB".into(),
        ..full_vm("v")
    });

    assert!(err.contains("ssh_authorized_key"), "{err}");
}

#[test]
fn an_egress_range_that_is_not_one_is_refused_naming_the_field_and_the_form() {
    let err = rejection(pb::VmSpec {
        egress_deny: vec!["10.0.0.0/8".into(), "example.com".into()],
        ..full_vm("v")
    });

    assert!(
        err.contains("egress_deny") && err.contains("example.com") && err.contains("a.b.c.d/n"),
        "{err}"
    );
}

#[test]
fn an_egress_range_with_host_bits_is_refused_saying_what_was_meant() {
    let err = rejection(pb::VmSpec {
        egress_allow: vec!["10.1.2.3/16".into()],
        ..full_vm("v")
    });

    assert!(
        err.contains("egress_allow") && err.contains("did you mean 10.1.0.0/16"),
        "{err}"
    );
}

#[test]
fn an_egress_range_listed_twice_is_refused() {
    let err = rejection(pb::VmSpec {
        egress_allow: vec!["192.0.2.7".into(), "192.0.2.7/32".into()],
        ..full_vm("v")
    });

    assert!(
        err.contains("egress_allow") && err.contains("192.0.2.7/32 is listed twice"),
        "{err}"
    );
}

#[test]
fn more_egress_ranges_than_a_vm_may_have_are_refused_naming_the_cap() {
    let many = (0..=Limits::MAX_EGRESS_RULES)
        .map(|i| format!("10.0.{i}.0/24"))
        .collect();
    let err = rejection(pb::VmSpec {
        egress_deny: many,
        ..full_vm("v")
    });

    assert!(
        err.contains("egress_deny")
            && err.contains(&format!("at most {}", Limits::MAX_EGRESS_RULES)),
        "{err}"
    );
}

#[test]
fn a_bad_egress_range_refuses_its_vm_alone() {
    let snap = convert::snapshot_from_wire(&pb::Snapshot {
        vms: vec![
            pb::VmSpec {
                egress_deny: vec!["not a range".into()],
                ..full_vm("bad")
            },
            full_vm("good"),
        ],
        ..pb::Snapshot::default()
    });

    assert_eq!(snap.vms.len(), 1);
    assert_eq!(snap.vms[0].id().as_str(), "good");
    assert_eq!(snap.rejected_vms.len(), 1);
    assert_eq!(snap.rejected_vms[0].raw_id, "bad");
}

fn port(protocol: &str, host_port: u32, guest_port: u32, host_address: &str) -> pb::PublishedPort {
    pb::PublishedPort {
        protocol: protocol.into(),
        host_port,
        guest_port,
        host_address: host_address.into(),
    }
}

#[test]
fn published_ports_survive_the_wire_both_ways() {
    let wire = pb::VmSpec {
        published_ports: vec![port("", 30080, 80, ""), port("udp", 30053, 53, "192.0.2.1")],
        ..full_vm("v")
    };

    let snap = convert::snapshot_from_wire(&pb::Snapshot {
        vms: vec![wire],
        ..pb::Snapshot::default()
    });
    let back = convert::vm_to_wire(&snap.vms[0]);

    assert_eq!(
        back.published_ports,
        [
            port("tcp", 30080, 80, ""),
            port("udp", 30053, 53, "192.0.2.1")
        ]
    );
}

#[test]
fn a_published_port_of_another_protocol_is_refused_naming_the_two_it_may_be() {
    let err = rejection(pb::VmSpec {
        published_ports: vec![port("sctp", 30080, 80, "")],
        ..full_vm("v")
    });

    assert!(
        err.contains("published_ports") && err.contains("\"tcp\" or \"udp\""),
        "{err}"
    );
}

#[test]
fn a_published_port_past_65535_or_zero_is_refused() {
    let past = rejection(pb::VmSpec {
        published_ports: vec![port("tcp", 70000, 80, "")],
        ..full_vm("v")
    });
    let zero = rejection(pb::VmSpec {
        published_ports: vec![port("tcp", 30080, 0, "")],
        ..full_vm("v")
    });

    assert!(past.contains("host_port 70000 is not a port"), "{past}");
    assert!(zero.contains("guest_port 0 is not a port"), "{zero}");
}

#[test]
fn a_host_port_published_twice_by_one_vm_is_refused() {
    let err = rejection(pb::VmSpec {
        published_ports: vec![
            port("tcp", 30080, 80, ""),
            port("tcp", 30080, 81, "192.0.2.1"),
        ],
        ..full_vm("v")
    });

    assert!(err.contains("published twice"), "{err}");
}

#[test]
fn a_port_published_on_loopback_is_refused_saying_why() {
    let err = rejection(pb::VmSpec {
        published_ports: vec![port("tcp", 30080, 80, "127.0.0.1")],
        ..full_vm("v")
    });

    assert!(
        err.contains("host_address 127.0.0.1") && err.contains("loopback"),
        "{err}"
    );
}

#[test]
fn a_cpu_cap_above_the_vms_vcpus_is_refused_saying_what_a_cap_is() {
    let err = rejection(pb::VmSpec {
        vcpus: 2,
        cpu_max_millis: 2001,
        ..full_vm("v")
    });

    assert!(
        err.contains("cpu_max_millis")
            && err.contains("10..=2000")
            && err.contains("thousandths of a CPU"),
        "{err}"
    );
}

#[test]
fn a_cpu_burst_past_the_caps_quota_is_refused() {
    let err = rejection(pb::VmSpec {
        cpu_max_millis: 500,
        cpu_burst_ms: 51,
        ..full_vm("v")
    });

    assert!(
        err.contains("cpu_burst_ms") && err.contains("1..=50"),
        "{err}"
    );
}

#[test]
fn a_negative_limit_is_refused_naming_its_field() {
    for (field, raw) in [
        (
            "disk_mbps",
            pb::VmSpec {
                disk_mbps: -1,
                ..full_vm("v")
            },
        ),
        (
            "disk_iops",
            pb::VmSpec {
                disk_iops: -5,
                ..full_vm("v")
            },
        ),
        (
            "net_mbps",
            pb::VmSpec {
                net_mbps: i64::MIN,
                ..full_vm("v")
            },
        ),
    ] {
        let err = rejection(raw);

        assert!(
            err.contains(field) && err.contains("neither 0 (the host's default)"),
            "{err}"
        );
    }
}

#[test]
fn zero_limits_are_the_hosts_defaults() {
    let snap = convert::snapshot_from_wire(&pb::Snapshot {
        vms: vec![pb::VmSpec {
            cpu_max_millis: 0,
            cpu_burst_ms: 0,
            disk_mbps: 0,
            disk_iops: 0,
            net_mbps: 0,
            ..full_vm("v")
        }],
        ..pb::Snapshot::default()
    });

    let Some(WantedVm::Present(d)) = snap.vms.first() else {
        panic!("accepted: {:?}", snap.rejected_vms);
    };
    assert!(d.spec.limits.is_hosts());
}

#[test]
fn a_readiness_probe_with_two_checks_is_refused_naming_the_field() {
    let err = rejection(pb::VmSpec {
        readiness: Some(pb::Readiness {
            serial_contains: "login:".into(),
            tcp_port: 22,
            ..pb::Readiness::default()
        }),
        ..full_vm("v")
    });

    assert!(
        err.contains("readiness") && err.contains("names two checks"),
        "{err}"
    );
}

#[test]
fn a_readiness_probe_with_no_check_or_a_bad_one_is_refused() {
    for (probe, says) in [
        (pb::Readiness::default(), "names no check"),
        (
            pb::Readiness {
                tcp_port: 70_000,
                ..pb::Readiness::default()
            },
            "is not a port",
        ),
        (
            pb::Readiness {
                serial_contains: "up\n".into(),
                ..pb::Readiness::default()
            },
            "not 1-256 printable bytes",
        ),
        (
            pb::Readiness {
                tcp_port: 22,
                period_s: 2,
                timeout_ms: 2001,
                ..pb::Readiness::default()
            },
            "timeout_ms 2001 is past 2000",
        ),
        (
            pb::Readiness {
                http_path: "/health".into(),
                ..pb::Readiness::default()
            },
            "http_path needs tcp_port",
        ),
        (
            pb::Readiness {
                tcp_port: 8080,
                http_path: "/a b".into(),
                ..pb::Readiness::default()
            },
            "is not a path",
        ),
    ] {
        let err = rejection(pb::VmSpec {
            readiness: Some(probe),
            ..full_vm("v")
        });

        assert!(err.contains("readiness") && err.contains(says), "{err}");
    }
}

#[test]
fn a_readiness_probes_zeros_are_its_defaults() {
    let snap = convert::snapshot_from_wire(&pb::Snapshot {
        vms: vec![pb::VmSpec {
            readiness: Some(pb::Readiness {
                serial_contains: "login:".into(),
                ..pb::Readiness::default()
            }),
            ..full_vm("v")
        }],
        ..pb::Snapshot::default()
    });

    let Some(WantedVm::Present(d)) = snap.vms.first() else {
        panic!("accepted: {:?}", snap.rejected_vms);
    };
    let probe = d.readiness.as_ref().expect("a probe");
    assert_eq!(
        probe.check,
        eitri_agent::model::Check::Serial("login:".into())
    );
    assert_eq!(
        (
            probe.period.as_secs(),
            probe.timeout.as_millis(),
            probe.grace.as_secs()
        ),
        (2, 1000, 60)
    );
    assert_eq!(probe.restart_after, None);
}

#[test]
fn bad_volume_id_in_a_vm_is_refused() {
    let err = rejection(pb::VmSpec {
        volume_ids: vec!["../../etc".into()],
        ..full_vm("v")
    });

    assert!(err.contains("volume_ids"), "{err}");
}

#[test]
fn duplicate_vm_ids_are_all_refused() {
    let snap = convert::snapshot_from_wire(&pb::Snapshot {
        vms: vec![full_vm("twin"), full_vm("twin")],
        ..Default::default()
    });

    assert!(snap.vms.is_empty());
    assert_eq!(snap.rejected_vms.len(), 2);
}

#[test]
fn tombstone_needs_only_a_valid_id() {
    let snap = only_vm(pb::VmSpec {
        vm_id: "vm-1".into(),
        tombstoned: true,
        power_state: "nonsense".into(),
        ..Default::default()
    });

    assert_eq!(
        snap.vms,
        vec![WantedVm::Tombstoned(Id::parse("vm-1").unwrap())]
    );
}

#[test]
fn volume_size_must_be_positive() {
    let snap = convert::snapshot_from_wire(&pb::Snapshot {
        volumes: vec![pb::VolumeSpec {
            volume_id: "vol-1".into(),
            size_gb: 0,
            tombstoned: false,
        }],
        ..Default::default()
    });

    assert!(snap.volumes.is_empty());
    assert_eq!(
        snap.rejected_volumes[0].id,
        Some(Id::parse("vol-1").unwrap())
    );
}

#[test]
fn a_vm_naming_more_volumes_than_it_may_attach_is_refused_naming_the_cap() {
    let mut raw = full_vm("vm-1");
    raw.volume_ids = (0..100_000).map(|n| format!("v{n}")).collect();

    let why = rejection(raw);

    assert!(why.contains("volume_ids"), "{why}");
    assert!(
        why.contains(&format!(
            "100000 volumes, at most {}",
            eitri_agent::model::Limits::MAX_VOLUMES_PER_VM
        )),
        "{why}"
    );
}

#[test]
fn a_volume_attached_twice_is_refused() {
    let mut raw = full_vm("vm-1");
    raw.volume_ids = vec!["data-1".into(), "data-2".into(), "data-1".into()];

    let why = rejection(raw);

    assert!(why.contains("volume data-1 is attached twice"), "{why}");
}

#[test]
fn an_idle_time_without_wake_on_traffic_is_refused_saying_to_set_both() {
    let err = rejection(pb::VmSpec {
        wake_on_traffic: false,
        idle_suspend_after_s: 60,
        ..full_vm("v")
    });

    assert!(
        err.contains("idle_suspend_after_s") && err.contains("needs wake_on_traffic"),
        "{err}"
    );
}

#[test]
fn an_idle_time_past_thirty_days_is_refused() {
    let err = rejection(pb::VmSpec {
        idle_suspend_after_s: 31 * 24 * 3600,
        ..full_vm("v")
    });

    assert!(
        err.contains("idle_suspend_after_s") && err.contains("at most 2592000"),
        "{err}"
    );
}
