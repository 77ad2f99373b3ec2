//! `make bench-store`: the state store at 1,000 records.
//!
//! - save_ms: saving every record (temp → fsync → rename → fsync dir each).
//! - raw_save_ms: the same bytes written by a bare open/write/fsync/rename
//!   loop in the same run: the physical floor for a durable replace on this
//!   disk. save_ratio = save_ms / raw_save_ms (1.0 = no overhead).
//! - load_mem_us: loading every record from the in-memory copy, as the
//!   heartbeat does (median of 101 runs).
//! - load_cold_ms: opening the store, which reads every record from disk.

use std::hint::black_box;
use std::time::{Duration, Instant};

use eitri_agent::model::{Id, VmSpec};
use eitri_agent::state::{Record, Store};

const RECORDS: usize = 1000;

fn record(n: usize) -> Result<Record, Box<dyn std::error::Error>> {
    let mut rec = Record::new(VmSpec {
        vm_id: Id::parse(&format!("vm-{n:05}"))?,
        name: format!("guest-{n}"),
        image_url: "http://mirror.test/images/debian-12.raw".into(),
        image_sha256: "ab".repeat(32),
        cloud_init: "#cloud-config\npackages: [nginx]\n".repeat(8),
        ssh_authorized_key: "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI user@test".into(),
        network: String::new(),
        volume_ids: vec![Id::parse(&format!("vol-{n}"))?],
        vcpus: 2,
        mem_mb: 1024,
        disk_gb: 10,
        limits: Default::default(),
        clone_of: None,
    });
    rec.created("1b4c6e3a-0000-4000-8000-000000000000".into(), true);
    rec.ip = "10.77.0.2".into();
    Ok(rec)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn raw_durable_writes(dir: &std::path::Path, payload: &[u8]) -> std::io::Result<Duration> {
    use std::io::Write;
    let start = Instant::now();
    for n in 0..RECORDS {
        let sub = dir.join(format!("d{n}"));
        std::fs::create_dir_all(&sub)?;
        let temp = sub.join(".t");
        let mut f = std::fs::File::create(&temp)?;
        f.write_all(payload)?;
        f.sync_all()?;
        std::fs::rename(&temp, sub.join("r"))?;
        std::fs::File::open(&sub)?.sync_all()?;
    }
    Ok(start.elapsed())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    eitri_agent::testkit::remove_on_signal(dir.path());
    let records = (0..RECORDS).map(record).collect::<Result<Vec<_>, _>>()?;

    let store = Store::open(&dir.path().join("state"))?;
    let start = Instant::now();
    for rec in &records {
        store.save(rec)?;
    }
    let save = start.elapsed();

    let payload = std::fs::read(store.layout().record(&records[0].spec.vm_id))?;
    let raw = raw_durable_writes(&dir.path().join("raw"), &payload)?;

    let mut loads: Vec<Duration> = (0..101)
        .map(|_| {
            let start = Instant::now();
            black_box(store.load_all());
            start.elapsed()
        })
        .collect();
    loads.sort();
    let load_mem = loads[loads.len() / 2];
    drop(store);

    let start = Instant::now();
    let reopened = Store::open(&dir.path().join("state"))?;
    let load_cold = start.elapsed();
    assert_eq!(reopened.load_all().len(), RECORDS, "every record reloads");

    println!(
        "save: {:.1} ms for {RECORDS} records ({:.2} ms each); bare durable replace: {:.1} ms",
        ms(save),
        ms(save) / RECORDS as f64,
        ms(raw)
    );
    println!(
        "bench=store records={RECORDS} save_ms={:.1} raw_save_ms={:.1} save_ratio={:.2} load_mem_us={:.0} load_cold_ms={:.1}",
        ms(save),
        ms(raw),
        save.as_secs_f64() / raw.as_secs_f64(),
        load_mem.as_secs_f64() * 1e6,
        ms(load_cold)
    );
    Ok(())
}
