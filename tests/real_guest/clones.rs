//! Templates and clones with a real guest: each clone of one template a
//! machine of its own (its random numbers, host key, hostname, address
//! and MAC), the template's files never written.

use super::*;

const TEMPLATE: &str = "tpl";

/// The template, booted with the delivered guest agent up, its generator
/// reseeded by its kernel just before it is wanted suspended as a
/// template; its entry, or `None` (skipped) without the static guest
/// agent. The reseed is the test's worst case: until the kernel's next
/// one (at least 13 s of its time away, where the clones' reads fall),
/// two copies of the template's guest would read the same random bytes
/// but for the agent's reseed.
fn template_saved(lab: &mut Lab) -> Option<Value> {
    let agent = static_guest_agent()?.display().to_string();
    lab.start(&["--guest-agent", &agent]);
    let booted = with(lab.vm(TEMPLATE), "cloud_init", json!(ROOT_LOGIN));
    let (row, _) = lab.boot(std::slice::from_ref(&booted), TEMPLATE);
    guest_agent_up(lab, TEMPLATE);
    // RNDRESEEDCRNG, as root.
    let reseed = "python3 -c \"import fcntl; fcntl.ioctl(open('/dev/urandom', 'w'), 0x5207)\"";
    lab.guest("root", &address(&row), reseed);
    let template = with(
        with(booted, "power_state", json!("suspended")),
        "template",
        json!(true),
    );
    lab.desire(std::slice::from_ref(&template));
    lab.wait_row(TEMPLATE, "suspended", SOON, |r| {
        r["power_state"] == "suspended"
    });
    Some(template)
}

/// A clone of the template: its own name and the lab's key, the
/// template's shape, ready when sshd answers.
fn clone_entry(lab: &Lab, id: &str) -> Value {
    let mut vm = lab.vm(id);
    let entry = vm.as_object_mut().expect("an object");
    entry.remove("image_url");
    entry.remove("image_sha256");
    entry.insert("clone_of".into(), json!(TEMPLATE));
    vm
}

/// The sha256 of each of the template's snapshot files and of its disk.
fn template_files(lab: &Lab) -> Vec<(String, String)> {
    let vm_dir = lab.state().join("vms").join(TEMPLATE);
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(vm_dir.join("snapshot"))
        .expect("the template's snapshot")
        .map(|e| e.expect("an entry").path())
        .collect();
    files.push(vm_dir.join("disk.raw"));
    files.sort();
    files
        .iter()
        .map(|f| {
            let sum = eitri_agent::image::sha256_file(f).expect("hash a template file");
            (f.display().to_string(), sum)
        })
        .collect()
}

/// `command`'s output in the clone whose row is `row`, its host key
/// checked strictly against the one the row reports.
fn strictly(lab: &Lab, row: &Value, command: &str) -> String {
    let id = row["vm_id"].as_str().unwrap_or_default();
    let known = lab.dir.path().join(format!("known-{id}"));
    let key = row["ssh_host_pubkey"].as_str().unwrap_or_default();
    std::fs::write(&known, format!("{id} {key}\n")).expect("write known hosts");
    let out = lab.ssh_with(
        USER,
        &address(row),
        command,
        &[
            format!("UserKnownHostsFile={}", known.display()),
            "StrictHostKeyChecking=yes".into(),
            format!("HostKeyAlias={id}"),
        ],
        None,
    );
    assert!(
        out.status.success(),
        "{command:?} on {id}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[test]
fn two_clones_of_one_template_are_machines_of_their_own() {
    let mut lab = lab!("two_clones_of_one_template_are_machines_of_their_own");
    let Some(template) = template_saved(&mut lab) else {
        return;
    };
    let before = template_files(&lab);

    lab.desire(&[
        template.clone(),
        clone_entry(&lab, "cl-1"),
        clone_entry(&lab, "cl-2"),
    ]);
    let (one, took) = lab.wait_row("cl-1", "running and ready", SOON, ready);
    timing("desired -> first clone ready", took);
    let (two, _) = lab.wait_row("cl-2", "running and ready", SOON, ready);
    // First thing, before anything else is asked of either guest.
    let random = "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'";
    let (random_1, random_2) = (strictly(&lab, &one, random), strictly(&lab, &two, random));
    println!("timing: the clones' first 32 random bytes: {random_1} and {random_2}");
    let mac = "cat /sys/class/net/*/address | grep -v 00:00:00:00:00:00";
    let seen = |row: &Value| {
        (
            strictly(&lab, row, "hostname"),
            strictly(&lab, row, mac),
            address(row),
            row["ssh_host_pubkey"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        )
    };
    let (seen_1, seen_2) = (seen(&one), seen(&two));
    let log = lab.agent_log();
    for line in log.lines().filter(|l| l.contains(": cloned from ")) {
        println!("timing: {line}");
    }

    assert_ne!(random_1, random_2, "the clones read the same random bytes");
    assert_eq!((seen_1.0.as_str(), seen_2.0.as_str()), ("cl-1", "cl-2"));
    assert_ne!(seen_1.1, seen_2.1, "MACs");
    assert_ne!(seen_1.2, seen_2.2, "addresses");
    assert_ne!(seen_1.3, seen_2.3, "host keys");
    assert_eq!(template_files(&lab), before, "the template's files changed");
}
