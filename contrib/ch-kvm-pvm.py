#!/usr/bin/env python3
"""ch-kvm-pvm.py CH_SOURCE_DIR - teach cloud-hypervisor's vCPU snapshot two facts of kvm_pvm.
ch-kvm-pvm.py --version - which edit this is (a binary built with another is built again).

kvm_pvm (the software KVM of the hosts the project is tested on) runs a guest's
kernel natively only once the guest has registered with it through MSR
0x4b564d10. cloud-hypervisor saves the MSRs KVM lists (KVM_GET_MSR_INDEX_LIST)
and kvm_pvm does not list that one, so a restored guest lost its registration
and every vCPU spun at 100% without a word. And caught just after a switch
from user to kernel mode, kvm_pvm reports the user's code and stack segments
(0x33/0x2b, DPL 3) at a kernel address: restored so, the guest's first
interrupt is delivered as if from user mode and it double-faults.

This edits hypervisor/src/kvm/mod.rs, `state()` (x86_64), so that for a
guest registered with kvm_pvm (KVM reads MSR 0x4b564d10 as not 0; the MSR is
asked, not /sys/module/kvm_pvm: a jailed VMM does not see /sys, and a first
version that looked there saved nothing under eitri-agent, so every guest it
resumed was emulated and died at its first rdtsc, "kvm-pvm: INTERNAL_ERROR in
batch emul"):
  1. MSR 0x4b564d10 is saved with the others (and so restored);
  2. a vCPU at a kernel address (the upper half, but the vsyscall page) with a
     DPL-3 code segment is saved with the kernel's segments, as SYSCALL loads
     them: CS = STAR[47:32], SS = CS + 8, both DPL 0.
On a host without kvm_pvm (or a guest not registered) nothing changes.
contrib/e2e-real applies it when it builds cloud-hypervisor on a kvm_pvm
host. Standard library only.

Written again from the description of a patch that was proven (300 of 300 busy
snapshot-restore cycles) and then lost with the machine it lived on; that one
told kernel mode by the MSR, this one by the address. Proven through the agent
(tests/real_guest.rs, suspend and resume twice of a busy Debian guest, and
make e2e-real) once it stopped looking for kvm_pvm in /sys.
"""
import sys

# Raised whenever what the edit does changes (not its words): contrib/e2e-real
# keeps it beside the binary it built and builds again when it differs.
VERSION = 2

if sys.argv[1:] == ["--version"]:
    print(VERSION)
    sys.exit(0)

path = sys.argv[1].rstrip("/") + "/hypervisor/src/kvm/mod.rs"
src = open(path).read()

msrs_old = """        let mut msr_entries = self.msrs.clone();
"""
msrs_new = """        let mut msr_entries = self.msrs.clone();
        // kvm_pvm: the guest's registration, which KVM's MSR list leaves out.
        // Asked of KVM itself: a VMM in a jail does not see /sys. Only
        // kvm_pvm reads it, and only a registered guest's is not 0 (a host
        // with kvm.ignore_msrs reads 0 for any MSR).
        let mut registration = vec![MsrEntry {
            index: 0x4b56_4d10,
            data: 0,
        }];
        let kvm_pvm =
            matches!(self.get_msrs(&mut registration), Ok(1)) && registration[0].data != 0;
        if kvm_pvm && !msr_entries.iter().any(|m| m.index == 0x4b56_4d10) {
            msr_entries.extend(registration);
        }
"""
state_old = """        let vcpu_events = self.get_vcpu_events()?;
        let tsc_khz = self.tsc_khz()?;

        Ok(VcpuKvmState {
            cpuid,
            msrs,
            vcpu_events,
            regs: regs.into(),
            sregs: sregs.into(),"""
state_new = """        let vcpu_events = self.get_vcpu_events()?;
        let tsc_khz = self.tsc_khz()?;

        let regs: kvm_bindings::kvm_regs = regs.into();
        let mut sregs: kvm_bindings::kvm_sregs = sregs.into();
        // kvm_pvm: a vCPU just entered from user mode may be reported with the
        // user's segments at a kernel address; save the kernel's (SYSCALL's).
        let vsyscall_page = 0xffff_ffff_ff60_0000_u64;
        if kvm_pvm
            && regs.rip >= 0xffff_8000_0000_0000
            && regs.rip & !0xfff != vsyscall_page
            && sregs.cs.dpl == 3
        {
            if let Some(star) = msrs.iter().find(|m| m.index == 0xc000_0081) {
                let kernel_cs = ((star.data >> 32) & 0xffff) as u16;
                sregs.cs.selector = kernel_cs;
                sregs.cs.dpl = 0;
                sregs.ss.selector = kernel_cs + 8;
                sregs.ss.dpl = 0;
            }
        }

        Ok(VcpuKvmState {
            cpuid,
            msrs,
            vcpu_events,
            regs,
            sregs,"""

for old, new, what in [(msrs_old, msrs_new, "the MSR list"), (state_old, state_new, "the saved segments")]:
    if src.count(old) != 1:
        sys.exit(f"ch-kvm-pvm.py: {path}: the code for {what} is not where this patch expects it; "
                 "this cloud-hypervisor is newer or older than the one it was written for")
    src = src.replace(old, new)
open(path, "w").write(src)
print("ch-kvm-pvm.py: patched the vCPU snapshot for kvm_pvm", file=sys.stderr)
