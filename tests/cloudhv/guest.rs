//! The guest agent through the VMM's vsock socket: the stand-in's
//! scripted guest answers as `eitri-guest` does, or misbehaves as a
//! hostile tenant's agent would.

use super::*;

use eitri_agent::guest::{AskError, Said, SystemState, ask};
use eitri_agent::pb::guest::{StatusAsk, request};

/// A bound for one exchange in these tests: a hostile guest must cost no
/// more than this.
const EXCHANGE: Duration = Duration::from_secs(1);

fn status_of(h: &Host, vm: &str) -> Result<eitri_agent::guest::Asked, AskError> {
    let pid = h.pid(vm).expect("the VM's hypervisor runs") as u32;
    ask(
        &h.backend.guest_socket(&id(vm)),
        pid,
        1,
        request::Ask::Status(StatusAsk {}),
        Deadline::after(EXCHANGE),
    )
}

/// A host whose guests' agent behaves as `how`, with vm-1 running on it;
/// then what a status request to it came to and how long it took.
fn asked_of_a_guest_that(how: &str) -> (Result<eitri_agent::guest::Asked, AskError>, Duration) {
    let h = Host::new(&[("STANDIN_GUEST_AGENT", how)]);
    h.tick(&h.vm("vm-1"));
    let started = Instant::now();
    let asked = status_of(&h, "vm-1");
    (asked, started.elapsed())
}

#[test]
fn the_guest_agent_answers_its_status_through_the_vmms_vsock_socket() {
    let h = Host::new(&[]);
    h.tick(&h.vm("vm-1"));

    let asked = status_of(&h, "vm-1").expect("answered");

    let Said::Status(status) = asked.said else {
        panic!("{:?}", asked.said)
    };
    assert_eq!(status.system, SystemState::Up);
    assert!(!status.boot_id.is_empty());
}

#[test]
fn a_guest_still_starting_says_so() {
    let h = Host::new(&[("STANDIN_GUEST_UP_AFTER_MS", "60000")]);
    h.tick(&h.vm("vm-1"));

    let asked = status_of(&h, "vm-1").expect("answered");

    let Said::Status(status) = asked.said else {
        panic!("{:?}", asked.said)
    };
    assert_eq!(status.system, SystemState::Starting);
}

#[test]
fn a_resumed_guest_answers_on_a_socket_bound_again_with_the_boot_it_had() {
    let h = Host::new(&[]);
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    let Said::Status(before) = status_of(&h, "vm-1").expect("answered").said else {
        panic!("not a status")
    };

    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    let after = status_of(&h, "vm-1").expect("answered after the resume");

    let Said::Status(after) = after.said else {
        panic!("not a status")
    };
    assert_eq!(after.boot_id, before.boot_id, "resumed, not booted again");
}

#[test]
fn a_guest_without_an_agent_is_told_apart_from_one_that_misbehaves() {
    let (asked, _) = asked_of_a_guest_that("none");

    let err = asked.expect_err("no agent answers");
    assert!(matches!(err, AskError::NotListening(_)), "{err}");
    assert!(!err.reached());
}

#[test]
fn a_guest_agent_that_stalls_costs_one_deadline() {
    let (asked, took) = asked_of_a_guest_that("stall");

    let err = asked.expect_err("a stall is no answer");
    assert!(
        err.reached() && err.to_string().contains("deadline"),
        "{err}"
    );
    // Bounded by the exchange's deadline, not by the guest.
    assert!(took < EXCHANGE * 3, "took {took:?}");
}

#[test]
fn a_guest_agent_that_floods_is_read_no_further_than_its_limit() {
    let (asked, took) = asked_of_a_guest_that("flood");

    // 0x41414141 bytes said: over the limit, refused before the body.
    let err = asked.expect_err("a flood is no answer");
    assert!(err.to_string().contains("over the"), "{err}");
    assert!(took < EXCHANGE * 3, "took {took:?}");
}

#[test]
fn a_guest_agent_that_says_a_huge_length_is_refused_before_reading_it() {
    let (asked, _) = asked_of_a_guest_that("oversize");

    let err = asked.expect_err("oversize is no answer");
    assert!(err.to_string().contains("4294967295 bytes"), "{err}");
}

#[test]
fn a_guest_agent_of_another_version_is_refused_naming_both() {
    let (asked, _) = asked_of_a_guest_that("old-version");

    let err = asked.expect_err("another version is no answer");
    assert!(
        err.to_string().contains("version 2; this agent speaks 1"),
        "{err}"
    );
}

#[test]
fn a_guest_agent_answering_another_request_is_refused() {
    let (asked, _) = asked_of_a_guest_that("wrong-id");

    let err = asked.expect_err("another request's answer is no answer");
    assert!(
        err.to_string()
            .contains("answered request 2 when asked request 1"),
        "{err}"
    );
}

#[test]
fn a_guest_agent_answering_garbage_is_refused() {
    let (asked, _) = asked_of_a_guest_that("garbage");

    let err = asked.expect_err("garbage is no answer");
    assert!(err.to_string().contains("not an answer"), "{err}");
}

#[test]
fn a_guest_agent_that_closes_mid_answer_is_named() {
    let (asked, _) = asked_of_a_guest_that("close");

    let err = asked.expect_err("half an answer is no answer");
    assert!(
        err.to_string()
            .contains("closed the connection 7 bytes into"),
        "{err}"
    );
}

#[test]
fn a_link_in_the_vsock_directory_to_another_socket_is_refused_unwritten() {
    let h = Host::new(&[]);
    h.tick(&h.vm("vm-1"));
    // A host service's socket, and the VMM (which owns the directory)
    // putting a link to it where its own socket was.
    let service = h.dir.path().join("service.sock");
    let listener = std::os::unix::net::UnixListener::bind(&service).expect("bind");
    let socket = h.backend.guest_socket(&id("vm-1"));
    std::fs::remove_file(&socket).expect("remove the VMM's socket");
    std::os::unix::fs::symlink(&service, &socket).expect("link");

    let asked = status_of(&h, "vm-1");

    let err = asked.expect_err("not its VMM");
    assert!(matches!(err, AskError::NotItsVmm { .. }), "{err}");
    listener.set_nonblocking(true).expect("nonblocking");
    let (mut conn, _) = listener.accept().expect("the agent connected");
    conn.set_nonblocking(true).expect("nonblocking");
    let mut got = [0u8; 64];
    let read = std::io::Read::read(&mut conn, &mut got);
    assert!(
        matches!(read, Ok(0)),
        "the service was sent nothing: {read:?}"
    );
}

/// What the VM's current VMM logged.
fn vmm_log(h: &Host, vm: &str) -> String {
    std::fs::read_to_string(h.store.layout().hypervisor_log(&id(vm))).unwrap_or_default()
}

/// The digests of the entropy its guest agent was sent, as the stand-in
/// logged them.
fn reseeds(log: &str) -> Vec<String> {
    log.lines()
        .filter_map(|l| l.split("standin-guest reseeded bytes=64 sha256=").nth(1))
        .map(str::to_owned)
        .collect()
}

/// vm-1 booted, suspended and resumed on `h`.
fn resumed_once(h: &Host) {
    h.tick(&wanting(h, "vm-1", PowerState::Running));
    h.tick(&wanting(h, "vm-1", PowerState::Suspended));
    h.tick(&wanting(h, "vm-1", PowerState::Running));
}

#[test]
fn a_resumed_guest_is_sent_fresh_entropy_by_its_guest_agent() {
    let h = Host::new(&[]);

    resumed_once(&h);

    assert_eq!(
        reseeds(&vmm_log(&h, "vm-1")).len(),
        1,
        "{}",
        vmm_log(&h, "vm-1")
    );
    let counts = h.engine().counts();
    assert_eq!(
        (
            counts.made_whole.get("done"),
            counts.guest_after_resume.count()
        ),
        (1, 1)
    );
}

#[test]
fn each_resume_sends_entropy_of_its_own() {
    let h = Host::new(&[]);
    resumed_once(&h);
    let first = reseeds(&vmm_log(&h, "vm-1"));

    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    let second = reseeds(&vmm_log(&h, "vm-1"));

    assert_eq!((first.len(), second.len()), (1, 1));
    assert_ne!(first, second);
}

#[test]
fn a_guest_without_an_agent_resumes_and_is_counted_so() {
    let h = Host::new(&[("STANDIN_GUEST_AGENT", "none")]);

    resumed_once(&h);

    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert_eq!(h.engine().counts().made_whole.get("no_agent"), 1);
}

#[test]
fn a_guest_agent_that_stalls_after_a_resume_leaves_the_vm_running() {
    let h = Host::new(&[("STANDIN_GUEST_AGENT", "stall")]);

    resumed_once(&h);

    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert_eq!(h.engine().counts().made_whole.get("failed"), 1);
}

/// Where `first` and then `then` are in `log`, if both are, in that order.
fn in_order(log: &str, first: &str, then: &str) -> bool {
    match (log.find(first), log.rfind(then)) {
        (Some(a), Some(b)) => a < b,
        _ => false,
    }
}

#[test]
fn a_guest_is_warned_by_its_guest_agent_before_it_is_paused_to_be_saved() {
    let h = Host::new(&[]);
    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    let log = vmm_log(&h, "vm-1");
    assert!(
        in_order(
            &log,
            "standin-guest saving",
            "standin-api PUT /api/v1/vm.pause"
        ),
        "{log}"
    );
}

#[test]
fn a_guest_agent_that_stalls_when_warned_of_a_save_is_saved_all_the_same() {
    let h = Host::new(&[("STANDIN_GUEST_AGENT", "stall")]);
    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    assert_eq!(h.row("vm-1").power, Some(PowerState::Suspended));
}

/// One request of `ask` to vm-1's guest agent on `h`, answered.
fn asked(h: &Host, ask: request::Ask) -> Said {
    let pid = h.pid("vm-1").expect("the VM's hypervisor runs") as u32;
    eitri_agent::guest::ask(
        &h.backend.guest_socket(&id("vm-1")),
        pid,
        7,
        ask,
        Deadline::after(EXCHANGE),
    )
    .expect("answered")
    .said
}

#[test]
fn an_identity_is_applied_and_confirmed_back() {
    let h = Host::new(&[]);
    h.tick(&h.vm("vm-1"));
    let identity = eitri_agent::pb::guest::Identity {
        hostname: "clone-7".into(),
        user: "debian".into(),
        authorized_keys: vec!["ssh-ed25519 AAAAkey a@b".into()],
        ..Default::default()
    };

    let said = asked(&h, request::Ask::Identity(identity));

    let Said::Identity {
        hostname,
        authorized_keys,
        ..
    } = said
    else {
        panic!("{said:?}")
    };
    assert_eq!((hostname.as_str(), authorized_keys), ("clone-7", 1));
    assert!(vmm_log(&h, "vm-1").contains("standin-guest identity hostname=clone-7"));
}

#[test]
fn a_freeze_is_confirmed_with_its_thaw_deadline_and_a_thaw_undoes_it() {
    let h = Host::new(&[]);
    h.tick(&h.vm("vm-1"));

    let frozen = asked(
        &h,
        request::Ask::Freeze(eitri_agent::pb::guest::Freeze {
            thaw_after_ms: 30_000,
        }),
    );
    let thawed = asked(&h, request::Ask::Thaw(eitri_agent::pb::guest::Thaw {}));

    assert!(
        matches!(&frozen, Said::Frozen { mounts, thaw_after_ms: 30_000 } if mounts == &["/"]),
        "{frozen:?}"
    );
    assert!(matches!(thawed, Said::Thawed { .. }), "{thawed:?}");
    let log = vmm_log(&h, "vm-1");
    assert!(
        log.contains("standin-guest frozen thaw_after_ms=30000"),
        "{log}"
    );
    assert!(log.contains("standin-guest thawed"), "{log}");
}

#[test]
fn a_power_off_is_answered_before_the_guest_goes() {
    let h = Host::new(&[]);
    h.tick(&h.vm("vm-1"));
    let pid = h.pid("vm-1").expect("running");

    let said = asked(
        &h,
        request::Ask::PowerOff(eitri_agent::pb::guest::PowerOff {}),
    );

    assert_eq!(said, Said::PoweringOff);
    let gone = Instant::now();
    while alive(pid) && gone.elapsed() < PATIENCE {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!alive(pid), "its VMM exited with its guest");
}

#[test]
fn the_vsock_directory_is_taken_back_once_the_vmm_bound_its_socket() {
    use std::os::unix::fs::MetadataExt;
    let h = Host::new(&[]);

    h.tick(&h.vm("vm-1"));

    let socket = h.backend.guest_socket(&id("vm-1"));
    let dir = socket.parent().expect("its directory");
    let meta = std::fs::metadata(dir).expect("the directory");
    assert_eq!(
        (meta.uid(), meta.mode() & 0o777),
        (nix::unistd::geteuid().as_raw(), 0o700),
        "the VMM's user can create nothing there"
    );
    let names: Vec<String> = std::fs::read_dir(dir)
        .expect("read")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["guest.sock"]);
    assert!(status_of(&h, "vm-1").is_ok(), "the agent still reaches it");
}

// ── readiness by the guest agent ────────────────────────────────────────

#[test]
fn a_vm_with_no_probe_is_ready_once_its_guest_agent_says_its_system_is_up() {
    let h = Host::new(&[("STANDIN_GUEST_UP_AFTER_MS", "1500")]).delivering_a_guest_agent();
    let snap = h.vm("vm-1");
    h.tick(&snap);
    let early = h.row("vm-1");

    let row = h.tick_until_row(&snap, "vm-1", |r| r.phase == Some(Phase::Ready));

    assert_eq!(early.phase, Some(Phase::Creating), "{early:?}");
    assert!(
        early
            .status_detail
            .starts_with("waiting for the guest: its guest agent says the system is starting"),
        "{early:?}"
    );
    assert_eq!(row.readiness, eitri_agent::model::GUEST_AGENT_READY);
    assert!(
        row.guest.starts_with("system up (systemd: running), up "),
        "{row:?}"
    );
}

#[test]
fn a_probed_vm_shows_what_its_guest_agent_says_and_stays_ready_by_its_probe() {
    let h = Host::new(&[]).delivering_a_guest_agent();
    let snap = crate::boot::probed(
        &h,
        "vm-1",
        eitri_agent::model::Check::Serial(h.serial_marker.clone()),
    );

    let row = h.tick_until_row(&snap, "vm-1", |r| {
        r.phase == Some(Phase::Ready) && !r.guest.is_empty()
    });

    assert!(row.readiness.ends_with(" answered"), "{row:?}");
    assert_ne!(row.readiness, eitri_agent::model::GUEST_AGENT_READY);
    // The stand-in's guest says 400 of 512 MiB are available.
    assert_eq!(
        row.guest_memory,
        Some(eitri_agent::model::GuestMemory {
            total_kib: 512 << 10,
            available_kib: 400 << 10
        }),
        "{row:?}"
    );
}

#[test]
fn a_vm_with_no_probe_and_no_guest_agent_is_ready_by_its_hypervisor_and_says_so() {
    let h = Host::new(&[("STANDIN_GUEST_AGENT", "none")]);

    h.tick(&h.vm("vm-1"));

    let row = h.row("vm-1");
    assert_eq!(row.phase, Some(Phase::Ready));
    assert_eq!(
        row.readiness,
        "the hypervisor runs; no probe, no guest agent"
    );
    assert_eq!(row.guest, "");
}

#[test]
fn a_delivered_guest_agent_is_waited_for_from_the_boot_and_then_done_without() {
    let h = Host::new(&[("STANDIN_GUEST_AGENT", "none")]).delivering_a_guest_agent();
    let snap = h.vm("vm-1");
    h.tick(&snap);
    let waiting = h.row("vm-1");

    h.fakes.advance_clock(Duration::from_secs(121));
    h.tick(&snap);

    assert_eq!(waiting.phase, Some(Phase::Creating), "{waiting:?}");
    assert!(
        waiting
            .status_detail
            .starts_with("waiting for the guest: no guest agent answers, 0 s of 120 s"),
        "{waiting:?}"
    );
    let row = h.row("vm-1");
    assert_eq!(row.phase, Some(Phase::Ready), "{row:?}");
    assert_eq!(
        row.readiness,
        "the hypervisor runs; no probe, and no guest agent answered in 120 s"
    );
}

/// Every row of `vm` the engine published while `act` ran, each once, in
/// order: those said mid-pass included.
fn rows_published_during(
    h: &Host,
    vm: &str,
    act: impl FnOnce(),
) -> Vec<eitri_agent::model::VmStatus> {
    let done = std::sync::atomic::AtomicBool::new(false);
    let mut seen: Vec<eitri_agent::model::VmStatus> = Vec::new();
    std::thread::scope(|s| {
        let watcher = s.spawn(|| {
            let mut seen = Vec::new();
            while !done.load(std::sync::atomic::Ordering::Acquire) {
                let _ = h.engine().changes().recv_timeout(Duration::from_millis(5));
                let row = h
                    .engine()
                    .published()
                    .vms
                    .into_iter()
                    .find(|r| r.vm_id == vm);
                if let Some(row) = row.map(std::sync::Arc::unwrap_or_clone)
                    && seen.last() != Some(&row)
                {
                    seen.push(row);
                }
            }
            seen
        });
        act();
        done.store(true, std::sync::atomic::Ordering::Release);
        seen = watcher.join().expect("watcher");
    });
    seen
}

#[test]
fn a_guest_resumed_soon_after_its_boot_is_not_said_to_wait_for_its_guest_agent() {
    // Its status is answered late, so a row said before it was asked stands
    // long enough to be seen.
    let h = Host::new(&[("STANDIN_GUEST_STATUS_AFTER_MS", "300")]).delivering_a_guest_agent();
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    let rows = rows_published_during(&h, "vm-1", || {
        h.tick(&wanting(&h, "vm-1", PowerState::Running));
    });

    let held: Vec<_> = rows
        .iter()
        .filter(|r| r.phase == Some(Phase::Creating))
        .collect();
    assert!(held.is_empty(), "{held:#?}");
    let last = rows.last().expect("a row");
    assert_eq!(
        (last.power, last.phase, last.readiness.as_str()),
        (
            Some(PowerState::Running),
            Some(Phase::Ready),
            "guest agent answered"
        )
    );
}

#[test]
fn a_guest_just_booted_is_said_to_wait_for_an_agent_not_yet_asked_not_one_that_does_not_answer() {
    let h = Host::new(&[("STANDIN_GUEST_STATUS_AFTER_MS", "300")]).delivering_a_guest_agent();

    let rows = rows_published_during(&h, "vm-1", || {
        h.tick(&wanting(&h, "vm-1", PowerState::Running));
    });

    let waits: Vec<&str> = rows
        .iter()
        .filter(|r| r.phase == Some(Phase::Creating) && r.power == Some(PowerState::Running))
        .map(|r| r.status_detail.as_str())
        .collect();
    assert_eq!(
        waits,
        ["waiting for the guest: its guest agent is not asked yet, 0 s of 120 s"]
    );
    assert_eq!(rows.last().map(|r| r.phase), Some(Some(Phase::Ready)));
}

#[test]
fn a_restarted_agent_does_not_wait_again_for_a_guest_agent_its_boot_waited_out() {
    let h = Host::new(&[("STANDIN_GUEST_AGENT", "none")]).delivering_a_guest_agent();
    let snap = h.vm("vm-1");
    h.tick(&snap);
    h.fakes.advance_clock(Duration::from_secs(121));
    h.tick(&snap);

    let h = h.restart().delivering_a_guest_agent();
    h.tick(&snap);

    assert_eq!(
        h.row("vm-1").phase,
        Some(Phase::Ready),
        "{:?}",
        h.row("vm-1")
    );
}

#[test]
fn a_guest_agent_answering_garbage_does_not_hold_its_vm_back() {
    let h = Host::new(&[("STANDIN_GUEST_AGENT", "garbage")]).delivering_a_guest_agent();

    h.tick(&h.vm("vm-1"));

    let row = h.row("vm-1");
    assert_eq!(row.phase, Some(Phase::Ready), "{row:?}");
    assert!(
        row.readiness
            .starts_with("the hypervisor runs; no probe; its guest agent fails: "),
        "{row:?}"
    );
}

#[test]
fn a_guest_agent_that_answers_late_is_waited_for_as_one_not_answering_yet() {
    let h = Host::new(&[("STANDIN_GUEST_AGENT", "stall")]).delivering_a_guest_agent();

    h.tick(&h.vm("vm-1"));

    let row = h.row("vm-1");
    assert_eq!(row.phase, Some(Phase::Creating), "{row:?}");
    assert!(
        row.status_detail
            .starts_with("waiting for the guest: its guest agent is late: "),
        "{row:?}"
    );
}

#[test]
fn a_vm_booted_again_from_its_disks_waits_for_its_guest_agent_again() {
    let h = Host::new(&[("STANDIN_GUEST_UP_AFTER_MS", "600000")]).delivering_a_guest_agent();
    let running = super::suspend::wanting(&h, "vm-1", PowerState::Running);
    h.tick(&running);
    h.fakes.advance_clock(Duration::from_secs(121));
    h.tick(&running);
    let waited_out = h.row("vm-1");
    h.tick(&super::suspend::wanting(&h, "vm-1", PowerState::Stopped));

    h.tick(&running);

    assert_eq!(waited_out.phase, Some(Phase::Ready), "{waited_out:?}");
    let row = h.row("vm-1");
    assert_eq!(row.phase, Some(Phase::Creating), "{row:?}");
    assert!(
        row.status_detail.starts_with(
            "waiting for the guest: its guest agent says the system is starting, 0 s of 120 s"
        ),
        "{row:?}"
    );
}
