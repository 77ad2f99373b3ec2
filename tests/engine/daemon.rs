//! The main loop on its own thread against the fake provisioner, and the
//! exchange with a fake control plane on 127.0.0.1: round trips, outages,
//! bad answers, backoff, and the rule that nothing local waits on the
//! network.
//!
//! The exchange is driven from the test, one contact at a time, with a
//! clock the test moves, so backoff is deterministic; the main loop runs
//! for real, as in the daemon.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::common::{SETTLE, config};
use crossbeam_channel::Sender;
use eitri_agent::daemon::{Clock, Contact, Daemon, Event, Exchange, Link, Parts};
use eitri_agent::deadline::Deadline;
use eitri_agent::pb;
use eitri_agent::reconcile::{Engine, EngineConfig};
use eitri_agent::source::{ControlPlane, HttpSource, SnapshotLimits};
use eitri_agent::state::Store;
use eitri_agent::status::ReportFile;
use eitri_agent::testkit::control_plane::{Answer, FakeControlPlane};
use eitri_agent::testkit::logs::capture;
use eitri_agent::testkit::{Call, Fakes, Op, id, image_url};

/// The main loop's own tick: long, so that in these tests every step is
/// one the test asked for (or one an event caused), never the timer's.
const TICK: Duration = Duration::from_secs(3600);
/// The exchange's tick: the backoff's base.
const CONTACT_TICK: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(16);

/// A clock the test moves by hand.
#[derive(Clone, Default)]
struct FakeClock(Arc<AtomicU64>);

impl FakeClock {
    fn advance(&self, by: Duration) {
        self.0.fetch_add(by.as_millis() as u64, Ordering::Relaxed);
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Duration {
        Duration::from_millis(self.0.load(Ordering::Relaxed))
    }
}

struct Agent {
    dir: Option<tempfile::TempDir>,
    fakes: Arc<Fakes>,
    clock: FakeClock,
    exchange: Exchange,
    link: Arc<Link>,
    engine: Arc<Engine>,
    events: Sender<Event>,
    main: Option<JoinHandle<()>>,
}

fn cp_config(url: &str, token_file: Option<std::path::PathBuf>) -> ControlPlane {
    ControlPlane {
        base_url: url.to_owned(),
        token_file,
        connect_timeout: Duration::from_millis(500),
        request_timeout: Duration::from_millis(500),
    }
}

fn limits() -> SnapshotLimits {
    SnapshotLimits {
        max_bytes: 64 * 1024,
        ..SnapshotLimits::default()
    }
}

fn agent_in(
    dir: tempfile::TempDir,
    fakes: Arc<Fakes>,
    url: &str,
    engine_config: EngineConfig,
    limits: SnapshotLimits,
) -> Agent {
    let store = Arc::new(Store::open(&dir.path().join("state")).expect("store"));
    let engine = Arc::new(Engine::new(
        Arc::clone(&store),
        fakes.seams(),
        engine_config,
    ));
    let clock = FakeClock::default();
    let (events, rx) = crossbeam_channel::unbounded();
    let link = Link::new(events.clone());
    let host = pb::HostInfo {
        host_id: "host-a".into(),
        ..Default::default()
    };
    let token = dir.path().join("token");
    let source = HttpSource::new(cp_config(url, Some(token)), limits, None, None);
    let exchange = Exchange::new(
        Box::new(source),
        host.clone(),
        CONTACT_TICK,
        BACKOFF_MAX,
        Box::new(clock.clone()),
        // Always the top of the window, so the ceiling is observable.
        Box::new(|| 1.0),
        Arc::clone(&link),
    );
    let daemon = Daemon::new(
        TICK,
        Parts {
            store,
            engine: Arc::clone(&engine),
            link: Arc::clone(&link),
            host,
            source: format!("control plane {url}"),
            remote: true,
            readiness: None,
            notes: vec![],
            metrics: None,
            image_cache_max: None,
            agents_dir: None,
            max_epoch_step: 1 << 32,
            usage: None,
        },
    );
    let generation = link.generation();
    let main = std::thread::spawn(move || daemon.run(&rx, None, Duration::from_secs(5)));
    // The main loop reports once as it starts.
    assert!(link.wait_generation(generation, SETTLE));
    Agent {
        dir: Some(dir),
        fakes,
        clock,
        exchange,
        link,
        engine,
        events,
        main: Some(main),
    }
}

fn agent(url: &str) -> Agent {
    agent_with(url, config())
}

fn agent_with(url: &str, engine_config: EngineConfig) -> Agent {
    let dir = tempfile::tempdir().expect("tempdir");
    write_token(dir.path(), 0o600);
    agent_in(dir, Fakes::new(), url, engine_config, limits())
}

fn write_token(dir: &std::path::Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("token");
    std::fs::write(&path, "s3cret\n").expect("token");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

impl Agent {
    /// One contact, then a step of the main loop, and every pass it
    /// started run to its end.
    fn tick(&mut self) -> Contact {
        let contact = self.exchange.contact();
        self.step();
        contact
    }

    /// The next contact, once it is due.
    fn tick_when_due(&mut self) -> Contact {
        self.clock.advance(self.exchange.due_in());
        self.tick()
    }

    /// A tick of the main loop alone.
    fn step(&self) {
        let (done, stepped) = crossbeam_channel::bounded(1);
        self.events
            .send(Event::Step { done: Some(done) })
            .expect("main loop");
        assert!(
            stepped.recv_timeout(SETTLE).is_ok(),
            "the main loop stepped"
        );
        assert!(self.engine.wait_idle(Deadline::after(SETTLE)));
    }

    /// The state dir; the token file is beside it, not in it (the agent
    /// makes everything in its state dir private at start).
    fn state_dir(&self) -> std::path::PathBuf {
        self.dir.as_ref().expect("dir").path().join("state")
    }

    fn report_file(&self) -> ReportFile {
        ReportFile::read(&self.state_dir()).expect("report.json")
    }

    /// Stops the main loop, keeping the state dir and the host (the fakes).
    fn stop(mut self) -> (tempfile::TempDir, Arc<Fakes>) {
        self.shut();
        (self.dir.take().expect("dir"), Arc::clone(&self.fakes))
    }

    fn shut(&mut self) {
        let _ = self.events.send(Event::Shutdown);
        if let Some(main) = self.main.take() {
            main.join().expect("main loop");
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.shut();
    }
}

fn snapshot_with(vm: &str, epoch: u64) -> pb::Snapshot {
    pb::Snapshot {
        epoch,
        vms: vec![wire_vm(vm)],
        ..Default::default()
    }
}

fn wire_vm(vm: &str) -> pb::VmSpec {
    pb::VmSpec {
        vm_id: vm.into(),
        name: vm.into(),
        image_url: image_url(vm),
        image_sha256: "ab".repeat(32),
        vcpus: 1,
        mem_mb: 256,
        disk_gb: 1,
        power_state: "running".into(),
        ..Default::default()
    }
}

fn row<'a>(report: &'a pb::ReportRequest, vm: &str) -> Option<&'a pb::VmStatus> {
    report.report.as_ref()?.vms.iter().find(|r| r.vm_id == vm)
}

fn failed_with(contact: &Contact, text: &str) -> bool {
    matches!(contact, Contact::Failed { error, .. } if error.contains(text))
}

#[test]
fn snapshot_step_report_round_trip() {
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 3)));
    let mut a = agent(&cp.url());

    a.tick();
    a.tick_when_due();

    let reports = cp.reports();
    let last = reports.last().expect("a report");
    let vm = row(last, "vm-1").expect("vm-1 row");
    assert_eq!(
        (vm.power_state.as_str(), vm.phase.as_str()),
        ("running", "ready")
    );
    assert_eq!(last.report.as_ref().map(|r| r.last_seen_epoch), Some(3));
    assert_eq!(
        last.host.as_ref().map(|h| h.host_id.as_str()),
        Some("host-a")
    );
}

#[test]
fn requests_carry_the_bearer_token_and_protobuf_type() {
    let cp = FakeControlPlane::start().expect("cp");
    let mut a = agent(&cp.url());

    a.tick();

    let requests = cp.requests();
    assert_eq!(requests.len(), 2, "snapshot then report");
    assert!(
        requests
            .iter()
            .all(|r| r.header("authorization") == Some("Bearer s3cret"))
    );
    assert!(
        requests
            .iter()
            .all(|r| r.header("content-type") == Some("application/x-protobuf"))
    );
}

#[test]
fn control_plane_down_at_start_then_up() {
    let port = FakeControlPlane::free_port().expect("port");
    let mut a = agent(&format!("http://127.0.0.1:{port}"));

    let down = a.tick();
    let cp = FakeControlPlane::start_on(port).expect("cp comes up");
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 1)));
    let up = a.tick_when_due();

    assert!(matches!(down, Contact::Failed { .. }), "{down:?}");
    assert!(
        a.state_dir().join("report.json").exists(),
        "reported while down"
    );
    assert_eq!(up, Contact::Ok);
    assert_eq!(a.fakes.count(|c| *c == Call::Boot(id("vm-1"))), 1);
}

/// Converges vm-1 from a good control plane, then makes every answer bad,
/// crashes the VM unnoticed, and ticks: the agent must restart it from its
/// last snapshot. Returns the failed contact and the number of boots.
fn crash_while_answers_are(bad: Answer) -> (Contact, usize) {
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 1)));
    let mut a = agent(&cp.url());
    a.tick();
    cp.answer_snapshots(bad);
    a.fakes.set_running(&id("vm-1"), false);

    let contact = a.tick_when_due();

    (contact, a.fakes.count(|c| *c == Call::Boot(id("vm-1"))))
}

#[test]
fn server_errors_leave_the_agent_on_its_last_snapshot() {
    let (contact, boots) = crash_while_answers_are(Answer::Status(500));

    assert!(failed_with(&contact, "500"), "{contact:?}");
    assert_eq!(boots, 2, "restarted from the last snapshot");
}

#[test]
fn garbage_leaves_the_agent_on_its_last_snapshot() {
    let (contact, boots) = crash_while_answers_are(Answer::Garbage);

    assert!(failed_with(&contact, "not a valid message"), "{contact:?}");
    assert_eq!(boots, 2);
}

#[test]
fn oversized_answers_leave_the_agent_on_its_last_snapshot() {
    let (contact, boots) = crash_while_answers_are(Answer::Oversized(1 << 20));

    assert!(failed_with(&contact, "larger than"), "{contact:?}");
    assert_eq!(boots, 2);
}

#[test]
fn a_server_slower_than_the_timeout_leaves_the_agent_on_its_last_snapshot() {
    let slow = Answer::Slow(
        Duration::from_secs(2),
        Box::new(Answer::Snapshot(pb::Snapshot::default())),
    );

    let (contact, boots) = crash_while_answers_are(slow);

    assert!(matches!(contact, Contact::Failed { .. }), "{contact:?}");
    assert_eq!(boots, 2);
}

#[test]
fn rejected_token_is_said_plainly() {
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Status(401));
    let mut a = agent(&cp.url());

    let contact = a.tick();

    assert!(failed_with(&contact, "token rejected"), "{contact:?}");
}

#[test]
fn a_token_file_others_can_read_is_refused_naming_the_fix() {
    let cp = FakeControlPlane::start().expect("cp");
    let dir = tempfile::tempdir().expect("tempdir");
    write_token(dir.path(), 0o644);
    let mut a = agent_in(dir, Fakes::new(), &cp.url(), config(), limits());

    let contact = a.tick();

    assert!(failed_with(&contact, "chmod 600"), "{contact:?}");
    assert!(cp.requests().is_empty(), "the token was never sent");
}

#[test]
fn restart_during_an_outage_keeps_converging() {
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 1)));
    let mut a = agent(&cp.url());
    a.tick();
    let port = cp.port();
    drop(cp);
    let (dir, fakes) = a.stop();
    fakes.set_running(&id("vm-1"), false);

    let mut restarted = agent_in(
        dir,
        fakes,
        &format!("http://127.0.0.1:{port}"),
        config(),
        limits(),
    );
    let contact = restarted.tick();

    assert!(matches!(contact, Contact::Failed { .. }));
    assert_eq!(restarted.fakes.count(|c| *c == Call::Boot(id("vm-1"))), 2);
}

#[test]
fn a_restarted_agent_acts_on_what_its_source_says_not_on_the_older_snapshot_it_persisted() {
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 1)));
    let mut a = agent(&cp.url());
    a.tick();
    let (dir, fakes) = a.stop();
    // What a previous agent persisted can lag what it did: here the VM is
    // down, and the control plane now wants it stopped.
    fakes.set_running(&id("vm-1"), false);
    let mut stopped = snapshot_with("vm-1", 1);
    stopped.vms[0].power_state = "stopped".into();
    cp.answer_snapshots(Answer::Snapshot(stopped));

    let mut restarted = agent_in(dir, fakes, &cp.url(), config(), limits());
    restarted.tick();

    assert_eq!(
        restarted.fakes.count(|c| *c == Call::Boot(id("vm-1"))),
        1,
        "booted once, by the first agent; never by the persisted snapshot"
    );
    let file = restarted.report_file();
    assert!(
        file.report
            .vms
            .iter()
            .any(|r| r.vm_id == "vm-1" && r.power_state == "stopped"),
        "{:?}",
        file.report.vms
    );
}

#[test]
fn the_newest_report_is_sent_when_the_control_plane_returns() {
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 1)));
    let mut a = agent(&cp.url());
    a.tick();
    cp.answer_snapshots(Answer::Status(503));
    cp.answer_reports(Answer::Status(503));
    a.fakes.set_addresses(&id("vm-1"), "10.77.0.9", "");
    a.tick_when_due();
    a.tick_when_due();
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 1)));
    cp.answer_reports(Answer::Accepted);

    a.tick_when_due();

    let last = cp.reports().pop().expect("reports");
    assert_eq!(row(&last, "vm-1").map(|r| r.ip.as_str()), Some("10.77.0.9"));
}

#[test]
fn backoff_grows_to_its_cap_and_resets_on_success() {
    let port = FakeControlPlane::free_port().expect("port");
    let mut a = agent(&format!("http://127.0.0.1:{port}"));

    let retries: Vec<Duration> = (0..7)
        .map(|_| match a.tick_when_due() {
            Contact::Failed { retry_in, .. } => retry_in,
            other => panic!("expected a failure, got {other:?}"),
        })
        .collect();
    let cp = FakeControlPlane::start_on(port).expect("cp");
    let recovered = a.tick_when_due();
    drop(cp);
    let after = a.tick_when_due();

    let s = Duration::from_secs;
    assert_eq!(retries, vec![s(1), s(2), s(4), s(8), s(16), s(16), s(16)]);
    assert_eq!(recovered, Contact::Ok);
    assert!(
        matches!(after, Contact::Failed { retry_in, .. } if retry_in == s(1)),
        "{after:?}"
    );
}

#[test]
fn no_contact_is_made_while_backing_off() {
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Status(500));
    let mut a = agent(&cp.url());
    a.tick_when_due();
    a.tick_when_due();
    let before = cp.requests().len();

    let waiting = a.exchange.contact_if_due();

    assert_eq!(waiting, None);
    assert_eq!(cp.requests().len(), before);
}

/// A source whose every fetch takes `takes` on the test's clock, then
/// fails: a control plane that times out.
struct SlowFailing {
    clock: FakeClock,
    takes: Duration,
}

impl eitri_agent::source::Source for SlowFailing {
    fn fetch(
        &mut self,
        _host: &pb::HostInfo,
    ) -> Result<Option<eitri_agent::source::Desired>, eitri_agent::source::SourceError> {
        self.clock.advance(self.takes);
        Err(eitri_agent::source::SourceError::Status {
            url: "http://cp.test/v1/agent/snapshot".into(),
            status: 504,
        })
    }
    fn send_report(
        &mut self,
        _host: &pb::HostInfo,
        _report: &pb::Report,
    ) -> Result<(), eitri_agent::source::SourceError> {
        Ok(())
    }
    fn is_remote(&self) -> bool {
        true
    }
    fn describe(&self) -> String {
        "a slow control plane".into()
    }
}

#[test]
fn backoff_is_measured_from_the_end_of_the_failed_attempt() {
    let clock = FakeClock::default();
    let (events, _rx) = crossbeam_channel::unbounded();
    let mut exchange = Exchange::new(
        Box::new(SlowFailing {
            clock: clock.clone(),
            takes: Duration::from_secs(3),
        }),
        pb::HostInfo::default(),
        CONTACT_TICK,
        BACKOFF_MAX,
        Box::new(clock.clone()),
        Box::new(|| 1.0),
        Link::new(events),
    );
    exchange.contact();
    exchange.contact();

    let third = exchange.contact();

    // The third failure backs off 4 s; the request's own 3 s do not count.
    assert!(
        matches!(third, Contact::Failed { retry_in, .. } if retry_in == Duration::from_secs(4)),
        "{third:?}"
    );
    assert_eq!(exchange.due_in(), Duration::from_secs(4));
}

#[test]
fn report_json_says_a_failed_contact_the_moment_it_failed() {
    let cp = FakeControlPlane::start().expect("cp");
    let mut a = agent(&cp.url());
    a.tick();
    cp.answer_snapshots(Answer::Status(500));

    a.tick_when_due();

    let file = a.report_file();
    assert!(file.contact.contains("500"), "{}", file.contact);
}

#[test]
fn a_stale_snapshot_is_fenced_and_not_kept() {
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 5)));
    let mut a = agent(&cp.url());
    a.tick();
    cp.answer_snapshots(Answer::Snapshot(pb::Snapshot {
        epoch: 2,
        ..Default::default()
    }));

    a.tick_when_due();
    cp.answer_snapshots(Answer::Status(500));
    a.tick_when_due();

    let reports = cp.reports();
    let fenced = reports
        .last()
        .and_then(|r| r.report.as_ref())
        .expect("fenced report");
    assert!(fenced.fence_violation);
    assert_eq!(
        a.fakes.count(|c| matches!(c, Call::Shutdown(_))),
        0,
        "vm-1 was not reaped"
    );
}

#[test]
fn a_fenced_snapshot_is_logged_once_while_it_repeats() {
    let log = capture();
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 5)));
    let mut a = agent(&cp.url());
    a.tick();
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 2)));

    for _ in 0..5 {
        a.tick_when_due();
    }

    assert_eq!(log.count(log::Level::Warn, "refusing a stale snapshot"), 1);
    let last = cp.reports().pop().expect("a report");
    assert!(last.report.is_some_and(|r| r.fence_violation));
}

#[test]
fn every_vm_of_a_new_snapshot_is_in_the_report_sent_with_it() {
    let cp = FakeControlPlane::start().expect("cp");
    let mut a = agent(&cp.url());
    // No pass gets past its first call: only the step's own rows exist.
    let gate = a.fakes.block(Op::Preflight, "");
    let mut snap = snapshot_with("vm-1", 1);
    snap.vms.push(wire_vm("vm-2"));
    cp.answer_snapshots(Answer::Snapshot(snap));

    a.exchange.contact();
    gate.release();

    let sent = cp.reports().pop().expect("a report");
    for vm in ["vm-1", "vm-2"] {
        let r = row(&sent, vm).unwrap_or_else(|| panic!("no row for {vm}"));
        assert_eq!(
            (r.phase.as_str(), r.status_detail.as_str()),
            ("creating", "queued")
        );
    }
}

#[test]
fn an_id_sent_twice_gets_one_row() {
    let cp = FakeControlPlane::start().expect("cp");
    let mut snap = snapshot_with("vm-1", 1);
    snap.vms.push(wire_vm("vm-1"));
    cp.answer_snapshots(Answer::Snapshot(snap));
    let mut a = agent(&cp.url());

    a.tick();

    let sent = cp.reports().pop().expect("a report");
    let rows: Vec<_> = sent
        .report
        .as_ref()
        .expect("report")
        .vms
        .iter()
        .filter(|r| r.vm_id == "vm-1")
        .collect();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].phase, "failed");
}

#[test]
fn redirects_are_refused_not_followed() {
    let elsewhere = FakeControlPlane::start().expect("elsewhere");
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Redirect(format!(
        "{}/v1/agent/snapshot",
        elsewhere.url()
    )));
    let mut a = agent(&cp.url());

    let contact = a.tick();

    assert!(
        failed_with(&contact, "redirects are refused"),
        "{contact:?}"
    );
    assert!(elsewhere.requests().is_empty(), "nothing went elsewhere");
}

#[test]
fn proxy_variables_in_the_environment_are_ignored() {
    let proxy = FakeControlPlane::start().expect("a would-be proxy");
    // SAFETY: set before this test starts any thread of its own; nextest
    // runs each test in a process of its own.
    unsafe {
        std::env::set_var("http_proxy", proxy.url());
        std::env::set_var("HTTP_PROXY", proxy.url());
        std::env::set_var("ALL_PROXY", proxy.url());
    }
    let cp = FakeControlPlane::start().expect("cp");
    let mut a = agent(&cp.url());

    let contact = a.tick();

    assert_eq!(contact, Contact::Ok);
    assert!(
        proxy.requests().is_empty(),
        "nothing went through the proxy"
    );
    assert_eq!(cp.requests().len(), 2);
}

/// VmHWM of this process: the most resident memory it ever had, in KiB.
fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

#[test]
fn a_snapshot_of_millions_of_empty_entries_is_refused_before_decoding() {
    // 16 MiB of two-byte VM entries (tag 2, length 0): 8 million entries,
    // which decoded would take gigabytes.
    let body: Vec<u8> = [0x12u8, 0x00].repeat(8 << 20);
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Raw(body));
    let dir = tempfile::tempdir().expect("tempdir");
    write_token(dir.path(), 0o600);
    let big_answers = SnapshotLimits {
        max_bytes: 32 << 20,
        ..SnapshotLimits::default()
    };
    let mut a = agent_in(dir, Fakes::new(), &cp.url(), config(), big_answers);
    let before = peak_rss_kib();

    let contact = a.tick();

    let grew_mib = (peak_rss_kib() - before) / 1024;
    assert!(
        failed_with(&contact, "8388608 VM entries, more than 10000"),
        "{contact:?}"
    );
    assert!(grew_mib < 50, "peak RSS grew by {grew_mib} MiB");
}

#[test]
fn a_hung_control_plane_delays_no_repair() {
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 1)));
    let mut a = agent(&cp.url());
    a.tick();
    // From now on every request hangs for 10 s, and the exchange runs on a
    // thread of its own as in the daemon, inside one of them.
    cp.answer_snapshots(Answer::Slow(
        Duration::from_secs(10),
        Box::new(Answer::Status(500)),
    ));
    let token = a.state_dir().with_file_name("token");
    let before = cp.requests().len();
    let exchange = Exchange::new(
        Box::new(HttpSource::new(
            ControlPlane {
                request_timeout: Duration::from_secs(30),
                ..cp_config(&cp.url(), Some(token))
            },
            limits(),
            None,
            None,
        )),
        pb::HostInfo::default(),
        CONTACT_TICK,
        BACKOFF_MAX,
        Box::new(eitri_agent::daemon::SystemClock::new()),
        Box::new(|| 1.0),
        Arc::clone(&a.link),
    )
    .spawn()
    .expect("source thread");
    assert!(wait_until(SETTLE, || cp.requests().len() > before));

    a.fakes.kill(&id("vm-1"));
    let repaired = wait_until(Duration::from_secs(5), || {
        a.fakes.count(|c| *c == Call::Boot(id("vm-1"))) == 2
    });

    // Bounded by half the hang: neither the control plane nor the main
    // loop's hour-long tick can have been what booted it again.
    assert!(
        repaired,
        "vm-1 was not booted again while the control plane hung"
    );
    assert_eq!(a.link.contact(), "ok", "still inside the hung request");
    exchange.ask_to_stop();
}

fn wait_until(bound: Duration, done: impl Fn() -> bool) -> bool {
    let until = std::time::Instant::now() + bound;
    while !done() {
        if std::time::Instant::now() > until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

#[test]
fn a_crash_loop_is_repaired_at_once_only_once_then_at_the_ticks_pace() {
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 1)));
    let mut a = agent(&cp.url());
    a.tick();
    a.fakes.kill(&id("vm-1"));
    assert!(a.engine.wait_idle(Deadline::after(SETTLE)));

    a.fakes.kill(&id("vm-1"));
    assert!(a.engine.wait_idle(Deadline::after(SETTLE)));
    let before_tick = a.fakes.count(|c| *c == Call::Boot(id("vm-1")));
    a.step();

    assert_eq!(before_tick, 2, "the second crash waits for the tick");
    assert_eq!(a.fakes.count(|c| *c == Call::Boot(id("vm-1"))), 3);
}

#[test]
fn a_repair_is_written_to_report_json_without_a_tick() {
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 1)));
    let mut a = agent(&cp.url());
    a.tick();
    a.fakes.set_addresses(&id("vm-1"), "100.77.0.9", "");
    let written = a.link.generation();

    a.fakes.kill(&id("vm-1"));

    // The repair's row differs (the address the backend now knows), so the
    // main loop writes it as a change, with no step asked for.
    assert!(a.link.wait_generation(written, SETTLE));
    let ip = wait_until(SETTLE, || {
        a.report_file()
            .report
            .vms
            .iter()
            .any(|r| r.vm_id == "vm-1" && r.ip == "100.77.0.9")
    });
    assert!(ip, "{:?}", a.report_file().report);
}

#[test]
fn shutdown_stays_within_the_grace_with_a_pass_stuck() {
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 1)));
    let dir = tempfile::tempdir().expect("tempdir");
    write_token(dir.path(), 0o600);
    let fakes = Fakes::new();
    let stuck = fakes.stall(Op::Boot, "vm-1");
    let store = Arc::new(Store::open(&dir.path().join("state")).expect("store"));
    let engine = Arc::new(Engine::new(Arc::clone(&store), fakes.seams(), config()));
    let (events, rx) = crossbeam_channel::unbounded();
    let link = Link::new(events.clone());
    let daemon = Daemon::new(
        TICK,
        Parts {
            store,
            engine: Arc::clone(&engine),
            link: Arc::clone(&link),
            host: pb::HostInfo::default(),
            source: "test".into(),
            remote: true,
            readiness: None,
            notes: vec![],
            metrics: None,
            image_cache_max: None,
            agents_dir: None,
            max_epoch_step: 1 << 32,
            usage: None,
        },
    );
    let mut exchange = Exchange::new(
        Box::new(HttpSource::new(
            cp_config(&cp.url(), Some(dir.path().join("token"))),
            limits(),
            None,
            None,
        )),
        pb::HostInfo::default(),
        CONTACT_TICK,
        BACKOFF_MAX,
        Box::new(FakeClock::default()),
        Box::new(|| 1.0),
        Arc::clone(&link),
    );
    let grace = Duration::from_millis(500);
    let main = std::thread::spawn(move || {
        daemon.run(&rx, None, grace);
        // The engine is dropped here as in the daemon: it must not wait
        // for the stuck pass all over again.
        drop(engine);
    });
    exchange.contact();
    assert!(stuck.wait_entered(1, SETTLE));

    let asked = std::time::Instant::now();
    events.send(Event::Shutdown).expect("main loop");
    main.join().expect("main loop");
    let took = asked.elapsed();
    stuck.release();

    // A bound to fail on: before, the engine's drop waited 5 s more.
    assert!(took < grace + Duration::from_secs(2), "took {took:?}");
}

#[test]
fn a_full_disk_is_a_few_lines_in_the_log_not_lines_every_tick() {
    let log = capture();
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 1)));
    let root = tempfile::tempdir().expect("tempdir");
    let disk = eitri_agent::testkit::tmpfs::Tmpfs::mount(&root.path().join("state"), "2m");
    let dir = tempfile::TempDir::new_in(disk.path()).expect("state dir");
    write_token(dir.path(), 0o600);
    let mut a = agent_in(dir, Fakes::new(), &cp.url(), config(), limits());
    a.tick();
    disk.fill();
    // vm-1 is to stop (its stop intent cannot be saved), vm-2 is new (its
    // create attempt cannot be saved: a host condition, not an attempt),
    // and report.json cannot be written.
    let mut snap = snapshot_with("vm-1", 2);
    snap.vms[0].power_state = "stopped".into();
    snap.vms.push(wire_vm("vm-2"));
    cp.answer_snapshots(Answer::Snapshot(snap));

    for _ in 0..5 {
        a.tick_when_due();
    }

    let lines = |text| log.count(log::Level::Error, text) + log.count(log::Level::Warn, text);
    assert_eq!(lines("cannot write report.json"), 1);
    assert_eq!(lines("VM vm-1: not stopping it"), 1);
    assert_eq!(
        lines("VM vm-2: cannot create it until the host is fixed"),
        1
    );
    drop(a);
}

#[test]
fn an_empty_persisted_snapshot_is_no_snapshot_and_reaps_nothing() {
    let cp = FakeControlPlane::start().expect("cp");
    cp.answer_snapshots(Answer::Snapshot(snapshot_with("vm-1", 1)));
    let mut a = agent(&cp.url());
    a.tick();
    let port = cp.port();
    drop(cp);
    let (dir, fakes) = a.stop();
    // A torn write, or an operator's mistake: an empty protobuf decodes as
    // a valid empty snapshot, which would quarantine every VM.
    std::fs::write(dir.path().join("state/snapshot.pb"), b"").expect("truncate");

    let mut restarted = agent_in(
        dir,
        fakes,
        &format!("http://127.0.0.1:{port}"),
        config(),
        limits(),
    );
    restarted.tick();

    assert_eq!(
        restarted.fakes.count(|c| matches!(c, Call::Shutdown(_))),
        0,
        "nothing reaped"
    );
    let file = restarted.report_file();
    assert!(file.report.quarantined.is_empty());
    assert!(
        file.report
            .vms
            .iter()
            .any(|r| r.vm_id == "vm-1" && r.power_state == "running"),
        "the VM is still reported as it is: {:?}",
        file.report.vms
    );
}
