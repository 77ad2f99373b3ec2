//! Templates and clones with a real guest: each clone of one template a
//! machine of its own (its random numbers, host key and certificate,
//! hostname, address and MAC), the template's files never written, and a
//! clone destroyed leaving its template and siblings as they were.

use super::*;

const TEMPLATE: &str = "tpl";

/// The template, booted with the delivered guest agent up, `before` run
/// in it as root just before it is wanted suspended as a template; its
/// entry and what `before` printed, or `None` (skipped) without the
/// static guest agent.
fn template_saved_after(lab: &mut Lab, before: &str) -> Option<(Value, String)> {
    let agent = static_guest_agent()?.display().to_string();
    lab.start(&["--guest-agent", &agent]);
    let booted = with(lab.vm(TEMPLATE), "cloud_init", json!(ROOT_LOGIN));
    let (row, _) = lab.boot(std::slice::from_ref(&booted), TEMPLATE);
    guest_agent_up(lab, TEMPLATE);
    let printed = lab.guest("root", &address(&row), before);
    let template = with(
        with(booted, "power_state", json!("suspended")),
        "template",
        json!(true),
    );
    lab.desire(std::slice::from_ref(&template));
    lab.wait_row(TEMPLATE, "suspended", SOON, |r| {
        r["power_state"] == "suspended"
    });
    Some((template, printed))
}

/// The template, its generator reseeded by its kernel just before it is
/// wanted suspended as a template; its entry and its kernel's uptime at
/// that reseed. The reseed is the test's worst case: until the kernel's
/// next one (see [`self_reseeded`]), two copies of the template's guest
/// would read the same random bytes but for the agent's reseed.
fn template_saved(lab: &mut Lab) -> Option<(Value, f64)> {
    // RNDRESEEDCRNG, as root, then the uptime it was done at.
    let reseed = "python3 -c \"import fcntl; fcntl.ioctl(open('/dev/urandom', 'w'), 0x5207)\" \
                  && cut -d' ' -f1 /proc/uptime";
    let (template, reseeded_at) = template_saved_after(lab, reseed)?;
    let reseeded_at = reseeded_at.trim().parse().expect("the template's uptime");
    Some((template, reseeded_at))
}

/// How many reads of 32 random bytes each clone is asked for.
const READS: usize = 256;

/// Whether a guest kernel whose generator was last reseeded at uptime
/// `reseeded` (seconds) has reseeded it by itself, from its own pool and
/// the CPU's random instructions, by a read at uptime `read`: Linux 5.18
/// and later do at a read once the seed is older than half the uptime
/// (at least 1 s) in the first two minutes, and than 60 s after
/// (`crng_has_old_seed`). A clone's guest clock runs on from its
/// template's, through the time between the save and the restore, on
/// a host whose guests read the host's TSC.
fn self_reseeded(reseeded: f64, read: f64) -> bool {
    let interval = if read < 120.0 {
        (read / 2.0).max(1.0)
    } else {
        60.0
    };
    read - reseeded > interval
}

/// A clone of the template: its own name and the lab's key, the
/// template's shape, ready once its guest agent made it its own. No
/// probe: a probe's connections to its sshd would make each clone's
/// guest draw random bytes its sibling did not, and the check that two
/// clones read different bytes must not pass for that.
fn clone_entry(lab: &Lab, id: &str) -> Value {
    let mut vm = lab.vm(id);
    let entry = vm.as_object_mut().expect("an object");
    entry.remove("image_url");
    entry.remove("image_sha256");
    entry.remove("readiness");
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

/// Each clone wanting a host certificate: waits for the host keys the
/// agent reports and has `ca` certify each for its clone's id.
fn certified(lab: &Lab, template: &Value, ids: &[&str], ca: &Ca) -> Vec<Value> {
    let wanting: Vec<Value> = ids
        .iter()
        .map(|id| with(clone_entry(lab, id), "host_cert_required", json!(true)))
        .collect();
    let mut all = vec![template.clone()];
    all.extend(wanting.iter().cloned());
    lab.desire(&all);
    wanting
        .into_iter()
        .zip(ids)
        .map(|(vm, id)| {
            let (row, _) = lab.wait_row(id, "its host key", SOON, |r| {
                r["ssh_host_pubkey"].as_str().is_some_and(|k| !k.is_empty())
            });
            let public = row["ssh_host_pubkey"].as_str().unwrap_or_default();
            with(vm, "ssh_host_cert", json!(ca.sign(public, id, true)))
        })
        .collect()
}

/// `command`'s output in the clone whose row is `row`, its host key
/// checked strictly against the one the row reports.
fn strictly(lab: &Lab, row: &Value, command: &str) -> String {
    let id = row["vm_id"].as_str().unwrap_or_default();
    let key = row["ssh_host_pubkey"].as_str().unwrap_or_default();
    trusting(lab, row, &format!("{id} {key}"), command)
}

/// `command`'s output in the clone whose row is `row`, its host key
/// checked strictly against the one line `known` (its id's).
fn trusting(lab: &Lab, row: &Value, known_line: &str, command: &str) -> String {
    let id = row["vm_id"].as_str().unwrap_or_default();
    let known = lab.dir.path().join(format!("known-{id}"));
    std::fs::write(&known, format!("{known_line}\n")).expect("write known hosts");
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
    let Some((template, reseeded_at)) = template_saved(&mut lab) else {
        return;
    };
    let before = template_files(&lab);
    let ca = Ca::new(&lab, "host-ca");
    let clones = certified(&lab, &template, &["cl-1", "cl-2"], &ca);

    let mut all = vec![template.clone()];
    all.extend(clones.iter().cloned());
    lab.desire(&all);
    let (one, took) = lab.wait_row("cl-1", "running and ready", SOON, ready);
    timing("desired -> first clone ready", took);
    let (two, _) = lab.wait_row("cl-2", "running and ready", SOON, ready);
    // First thing, before anything else is asked of either guest: READS
    // reads of 32 bytes in a row, and the uptime they ended at. Each read
    // moves a guest's generator one key on, whatever it asks for; so two
    // guests of one generator, one of them some reads ahead of the other
    // (drawn by whatever else ran in it), share reads: the check below
    // sees that where a check of the first read alone would not.
    let random = format!(
        "dd if=/dev/urandom bs=32 count={READS} iflag=fullblock status=none \
         | od -An -tx1 -v -w32 | tr -d ' ' && cut -d' ' -f1 /proc/uptime"
    );
    let read = |row: &Value| {
        let out = strictly(&lab, row, &random);
        let mut lines: Vec<String> = out.lines().map(str::to_owned).collect();
        let uptime = lines.pop().and_then(|u| u.trim().parse::<f64>().ok());
        assert_eq!(lines.len(), READS, "{out}");
        (lines, uptime.expect("an uptime"))
    };
    // Both at once: what each guest draws while the other is read would
    // move one's reads along its stream.
    let ((random_1, read_1), (random_2, read_2)) = std::thread::scope(|s| {
        let first = s.spawn(|| read(&one));
        let second = read(&two);
        (first.join().expect("the first clone's read"), second)
    });
    let shared = random_1.iter().filter(|r| random_2.contains(r)).count();
    println!(
        "timing: the clones' first 32 random bytes: {} and {}, {shared} of their {READS} reads the same, read {:.1} s and {:.1} s of guest time after the template's reseed",
        random_1[0],
        random_2[0],
        read_1 - reseeded_at,
        read_2 - reseeded_at
    );
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
    // Each by its own certificate, the CA alone known.
    let by_ca = |row: &Value| {
        trusting(
            &lab,
            row,
            &format!(
                "@cert-authority {} {}",
                row["vm_id"].as_str().unwrap_or_default(),
                ca.public()
            ),
            "hostname",
        )
    };
    let (ca_1, ca_2) = (by_ca(&one), by_ca(&two));
    // Every key each presents, of any type: its own, none of its template's.
    let scanned = |row: &Value| {
        let out = lab::run(eitri_agent::testkit::tools::tool("ssh-keyscan").arg(address(row)));
        let mut keys: Vec<String> = out
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .map(|l| l.split_whitespace().skip(1).collect::<Vec<_>>().join(" "))
            .collect();
        keys.sort();
        keys
    };
    let own_key = |row: &Value| {
        let reported = row["ssh_host_pubkey"].as_str().unwrap_or_default();
        vec![
            reported
                .split_whitespace()
                .take(2)
                .collect::<Vec<_>>()
                .join(" "),
        ]
    };
    let (scanned_1, scanned_2) = (scanned(&one), scanned(&two));
    // One destroyed: its sibling and its template untouched.
    let mut without_one = vec![
        template.clone(),
        with(clones[0].clone(), "tombstoned", json!(true)),
    ];
    without_one.push(clones[1].clone());
    lab.desire(&without_one);
    lab.wait_report("cl-1", "destroyed", SOON * 2, |_| {
        lab.report().is_some_and(|r| {
            r["report"]["destroyed"]
                .as_array()
                .is_some_and(|d| d.contains(&json!("cl-1")))
        })
    });
    let sibling_after = strictly(&lab, &two, "hostname");
    let events = lab.events("cl-2");
    for line in events.lines() {
        println!("timing: events cl-2: {line}");
    }
    let log = lab.agent_log();
    for line in log.lines().filter(|l| l.contains(": cloned from ")) {
        println!("timing: {line}");
    }

    // Read before their kernels reseeded by themselves: else bytes that
    // differ would not show the agent's reseed.
    assert!(
        !self_reseeded(reseeded_at, read_1) && !self_reseeded(reseeded_at, read_2),
        "the clones read at {read_1} s and {read_2} s of uptime, their kernels' reseed of {reseeded_at} s too old to show the agent's"
    );
    assert_ne!(
        random_1[0], random_2[0],
        "the clones' first 32 random bytes are the same"
    );
    assert_eq!(shared, 0, "the clones' generators are one");
    assert_eq!((seen_1.0.as_str(), seen_2.0.as_str()), ("cl-1", "cl-2"));
    assert_ne!(seen_1.1, seen_2.1, "MACs");
    assert_ne!(seen_1.2, seen_2.2, "addresses");
    assert_ne!(seen_1.3, seen_2.3, "host keys");
    assert_eq!(
        (ca_1.as_str(), ca_2.as_str()),
        ("cl-1", "cl-2"),
        "by certificate"
    );
    assert_eq!(scanned_1, own_key(&one), "cl-1 presents only its own key");
    assert_eq!(scanned_2, own_key(&two), "cl-2 presents only its own key");
    assert!(!lab.state().join("vms").join("cl-1").exists());
    assert_eq!(sibling_after, "cl-2", "its sibling after it was destroyed");
    assert!(
        events
            .lines()
            .any(|l| l.contains("  Normal   Cloned ") && l.contains("cloned from tpl")),
        "{events}"
    );
    assert_eq!(template_files(&lab), before, "the template's files changed");
}

#[test]
fn a_running_template_pays_a_measured_pause_and_its_clone_logs_in_while_it_runs() {
    let mut lab =
        lab!("a_running_template_pays_a_measured_pause_and_its_clone_logs_in_while_it_runs");
    let Some(agent) = static_guest_agent() else {
        return;
    };
    lab.start(&["--guest-agent", &agent.display().to_string()]);
    let template = with(lab.vm(TEMPLATE), "template", json!(true));
    let (row, _) = lab.boot(std::slice::from_ref(&template), TEMPLATE);
    let pid = lab.hypervisor_pid(TEMPLATE);
    let saved = lab
        .state()
        .join("vms")
        .join(TEMPLATE)
        .join("template/manifest.json");
    lab.wait_report(TEMPLATE, "saved as a template", SOON, |_| saved.is_file());
    // Ready when its sshd answers, as an operator would have it: a guest
    // saved moments after its own boot is still starting its system.
    let readiness = lab.vm("cl-r")["readiness"].clone();
    let clone = with(clone_entry(&lab, "cl-r"), "readiness", readiness);

    lab.desire(&[template.clone(), clone]);
    let (one, took) = lab.wait_row("cl-r", "running and ready", SOON, ready);
    timing("desired -> clone of a running template ready", took);

    let log = lab.agent_log();
    let pause = log
        .lines()
        .find(|l| l.contains("saved as a template: its guest paused"))
        .unwrap_or_default()
        .to_owned();
    println!("timing: {pause}");
    assert!(!pause.is_empty(), "the pause is logged: {log}");
    assert_eq!(strictly(&lab, &one, "hostname"), "cl-r");
    assert_eq!(
        lab.hypervisor_pid(TEMPLATE),
        pid,
        "the template never stopped"
    );
    let template_row = crate::lab::row_of(&lab.report().expect("a report"), TEMPLATE);
    assert_eq!(template_row["power_state"], "running", "{template_row}");
    assert_eq!(
        lab.guest(USER, &address(&row), "hostname"),
        TEMPLATE,
        "the template answers as itself after its pause"
    );
    assert!(
        lab.events(TEMPLATE).contains("  Normal   Templated "),
        "{}",
        lab.events(TEMPLATE)
    );
}

/// The guest kernel's switch for its RCU stall check.
const STALL_SWITCH: &str = "/sys/module/rcupdate/parameters/rcu_cpu_stall_suppress";

#[test]
fn a_clone_of_a_template_saved_mid_grace_period_prints_no_stall_and_has_its_check_back() {
    let mut lab =
        lab!("a_clone_of_a_template_saved_mid_grace_period_prints_no_stall_and_has_its_check_back");
    // Grace periods one after another (each network namespace dropped
    // waits for some), so that one is in flight at the save; and a stall
    // reported after 3 s rather than 21, so that the test need not wait
    // long between the save and the clone.
    let busy = format!(
        "echo 3 > /sys/module/rcupdate/parameters/rcu_cpu_stall_timeout \
         && (nohup sh -c 'while :; do unshare -n true; done' >/dev/null 2>&1 &) \
         && sleep 1 && cat {STALL_SWITCH}"
    );
    let Some((template, switch)) = template_saved_after(&mut lab, &busy) else {
        return;
    };
    assert_eq!(switch, "0", "the template's stall check was on");
    // Three stall timeouts of the guest's clock, which runs on through
    // them when the clone is restored.
    std::thread::sleep(Duration::from_secs(10));

    lab.desire(&[template.clone(), clone_entry(&lab, "cl-q")]);
    let (clone, took) = lab.wait_row("cl-q", "running and ready", SOON, ready);
    timing(
        "desired -> clone of a template saved mid grace period ready",
        took,
    );
    // Past the second its check stays quiet after it runs again.
    std::thread::sleep(Duration::from_secs(3));

    let console = lab.console("cl-q", 200);
    let reached = lab
        .agent_log()
        .lines()
        .find(|l| l.contains("VM cl-q: cloned from tpl"))
        .unwrap_or_default()
        .to_owned();
    println!("timing: {reached}");
    assert!(
        !console.contains("stall"),
        "its console reports a stall: {console}"
    );
    assert_eq!(
        lab.guest("root", &address(&clone), &format!("cat {STALL_SWITCH}")),
        "0",
        "its stall check is back on"
    );
}
