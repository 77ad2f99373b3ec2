//! The state store's crash-safety and locking rules.

use eitri_agent::state::lifecycle::{Lifecycle, LifecycleParts};
use std::fs;
use std::os::unix::process::CommandExt;

use eitri_agent::model::{Id, VmSpec};
use eitri_agent::state::{Record, RecordSlot, Store, StoreError};

fn id(raw: &str) -> Id {
    Id::parse(raw).expect("test id")
}

fn record(vm: &str, attempts: u32) -> Record {
    let mut rec = Record::new(VmSpec {
        vm_id: id(vm),
        name: "web-1".into(),
        image_url: "http://images.test/base.raw".into(),
        image_sha256: "a".repeat(64),
        cloud_init: "#cloud-config\n".into(),
        ssh_authorized_key: "ssh-ed25519 AAAA test".into(),
        network: String::new(),
        volume_ids: vec![id("vol-1")],
        vcpus: 2,
        mem_mb: 512,
        disk_gb: 4,
        limits: Default::default(),
        clone_of: None,
    });
    rec.lifecycle = Lifecycle::from_parts(LifecycleParts {
        create_attempts: attempts,
        ..LifecycleParts::default()
    });
    rec
}

#[test]
fn saved_record_survives_reopen() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rec = record("vm-1", 2);
    Store::open(dir.path())
        .expect("open")
        .save(&rec)
        .expect("save");

    let store = Store::open(dir.path()).expect("reopen");

    let got = store.get(&id("vm-1")).expect("readable").expect("present");
    assert_eq!(*got, rec);
}

#[test]
fn a_record_in_place_but_not_yet_durable_is_read_by_the_next_agent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rec = record("vm-1", 1);
    let first = Store::open(dir.path()).expect("open");
    let unsynced = first.save_visible(&rec).expect("save");
    // The agent dies here, before make_durable: its successor, on the
    // same host, must count the attempt.
    drop(unsynced);
    drop(first);

    let store = Store::open(dir.path()).expect("reopen");

    let got = store.get(&id("vm-1")).expect("readable").expect("present");
    assert_eq!(*got, rec);
}

#[test]
fn interrupted_write_loads_the_old_record() {
    // A crash after the temp file was written but before the rename leaves
    // the temp file beside the old record.
    let dir = tempfile::tempdir().expect("tempdir");
    let old = record("vm-1", 1);
    let store = Store::open(dir.path()).expect("open");
    store.save(&old).expect("save");
    let temp = store
        .layout()
        .vm_dir(&id("vm-1"))
        .join(".record.json.tmp-999-0");
    fs::write(&temp, br#"{"format":1,"record":{"#).expect("half-written temp");
    drop(store);

    let store = Store::open(dir.path()).expect("reopen");
    store.sweep();

    let got = store.get(&id("vm-1")).expect("readable").expect("present");
    assert_eq!(*got, old);
    assert!(!temp.exists(), "the stray temp file is swept at start");
}

#[test]
fn truncated_record_is_unreadable_not_absent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    store.save(&record("vm-1", 1)).expect("save");
    let path = store.layout().record(&id("vm-1"));
    let bytes = fs::read(&path).expect("read");
    fs::write(&path, &bytes[..bytes.len() / 2]).expect("truncate");
    drop(store);

    let store = Store::open(dir.path()).expect("reopen");

    let err = store.get(&id("vm-1")).expect_err("unreadable");
    assert!(matches!(err, StoreError::UnreadableRecord { .. }), "{err}");
    assert!(matches!(
        store.load_all().get(&id("vm-1")),
        Some(RecordSlot::Unreadable(_))
    ));
}

#[test]
fn record_of_a_newer_format_is_unreadable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    store.save(&record("vm-1", 1)).expect("save");
    let path = store.layout().record(&id("vm-1"));
    let text = fs::read_to_string(&path).expect("read");
    fs::write(&path, text.replace("\"format\": 1", "\"format\": 2")).expect("rewrite");
    drop(store);

    let store = Store::open(dir.path()).expect("reopen");

    let err = store.get(&id("vm-1")).expect_err("newer format");
    assert!(err.to_string().contains("newer agent"), "{err}");
}

#[test]
fn absent_record_is_none() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");

    let got = store.get(&id("nobody")).expect("no error");

    assert!(got.is_none());
}

#[test]
fn epoch_survives_reopen() {
    let dir = tempfile::tempdir().expect("tempdir");
    Store::open(dir.path())
        .expect("open")
        .save_epoch(42)
        .expect("save epoch");

    let store = Store::open(dir.path()).expect("reopen");

    assert_eq!(store.epoch(), 42);
}

#[test]
fn epoch_only_rises() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    store.save_epoch(9).expect("save 9");

    store.save_epoch(3).expect("save 3");

    assert_eq!(store.epoch(), 9);
}

#[test]
fn unreadable_epoch_fails_open_to_zero() {
    let dir = tempfile::tempdir().expect("tempdir");
    fs::write(dir.path().join("epoch"), b"not a number").expect("garbage epoch");

    let store = Store::open(dir.path()).expect("open");

    assert_eq!(store.epoch(), 0);
}

#[test]
fn second_store_on_a_locked_dir_fails_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _first = Store::open(dir.path()).expect("first");

    let err = Store::open(dir.path()).err().expect("second must fail");

    assert!(matches!(err, StoreError::Locked { .. }), "{err}");
    assert!(
        err.to_string().contains(&dir.path().display().to_string()),
        "{err}"
    );
}

/// `flock` holding the state dir's lock for `seconds`, and its pid, once
/// it holds it.
fn hold_the_lock(dir: &std::path::Path, seconds: &str) -> std::process::Child {
    drop(Store::open(dir).expect("make the state dir"));
    let lock = eitri_agent::state::Layout::new(dir).lock();
    // In a group of its own, so that its sleep can be ended with it; the
    // sleep does not inherit the lock (--close).
    let mut holder = eitri_agent::testkit::tools::tool("flock")
        .args(["--exclusive", "--close"])
        .arg(&lock)
        .args(["sleep", seconds])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .expect("flock");
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while eitri_agent::state::holders::holders(&lock).is_empty() {
        assert!(
            std::time::Instant::now() < until,
            "flock never took the lock"
        );
        assert!(holder.try_wait().expect("flock").is_none(), "flock exited");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    holder
}

#[test]
fn a_lock_let_go_within_the_patience_is_taken() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut holder = hold_the_lock(dir.path(), "0.3");

    let store = Store::open_within(dir.path(), std::time::Duration::from_secs(10));

    assert!(store.is_ok(), "{:?}", store.err());
    assert!(holder.try_wait().expect("flock").is_some());
}

#[test]
fn a_lock_held_past_the_patience_is_refused_naming_its_holder() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut holder = hold_the_lock(dir.path(), "30");

    let err = Store::open_within(dir.path(), std::time::Duration::from_millis(300))
        .err()
        .expect("still held");

    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(holder.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
    let _ = holder.wait();
    assert!(
        err.to_string()
            .contains(&format!("held by pid {} (flock)", holder.id())),
        "{err}"
    );
}

#[test]
fn lock_is_released_when_the_store_drops() {
    let dir = tempfile::tempdir().expect("tempdir");
    drop(Store::open(dir.path()).expect("first"));

    let second = Store::open(dir.path());

    assert!(second.is_ok());
}

#[test]
fn delete_removes_the_vm_directory_and_record() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    store.save(&record("vm-1", 1)).expect("save");
    fs::write(store.layout().root_disk(&id("vm-1")), b"disk").expect("disk");

    store.delete(&id("vm-1")).expect("delete");

    assert!(store.get(&id("vm-1")).expect("readable").is_none());
    assert!(!store.layout().vm_dir(&id("vm-1")).exists());
}

#[test]
fn delete_never_touches_volumes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    store.save(&record("vm-1", 1)).expect("save");
    let volume = store.layout().volume(&id("vol-1"));
    fs::write(&volume, b"customer data").expect("volume");

    store.delete(&id("vm-1")).expect("delete");

    assert_eq!(fs::read(&volume).expect("volume kept"), b"customer data");
}

#[test]
fn half_finished_delete_is_completed_by_the_start_up_sweep() {
    let dir = tempfile::tempdir().expect("tempdir");
    let leftover = dir.path().join("vms/.deleting-vm-1-77-0");
    fs::create_dir_all(&leftover).expect("leftover");
    fs::write(leftover.join("disk.raw"), b"x").expect("file");

    let store = Store::open(dir.path()).expect("open");
    store.sweep();

    assert!(!leftover.exists());
    assert!(store.load_all().is_empty());
}

#[test]
fn directory_that_is_not_an_id_is_ignored() {
    let dir = tempfile::tempdir().expect("tempdir");
    fs::create_dir_all(dir.path().join("vms/bad name")).expect("odd dir");

    let store = Store::open(dir.path()).expect("open");

    assert!(store.load_all().is_empty());
}

#[test]
fn records_are_served_from_memory() {
    // Removing the file behind the store's back does not change what it
    // serves: this agent is the only writer, so memory is the truth.
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("open");
    store.save(&record("vm-1", 1)).expect("save");
    fs::remove_file(store.layout().record(&id("vm-1"))).expect("remove");

    let all = store.load_all();

    assert!(matches!(
        all.get(&id("vm-1")),
        Some(RecordSlot::Readable(_))
    ));
}

#[test]
fn a_record_saved_into_a_state_dir_removed_under_the_store_fails_and_makes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state");
    let store = Store::open(&state).expect("open");
    fs::remove_dir_all(&state).expect("removed under it");

    let saved = store.save(&record("vm-1", 1));

    assert!(saved.is_err(), "{saved:?}");
    assert!(!state.exists(), "no state dir of one record made again");
}
