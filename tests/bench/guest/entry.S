/* The I/O guest's entry: cloud-hypervisor starts a PVH kernel in 32-bit
 * protected mode, paging off, no stack, %ebx pointing at hvm_start_info.
 * This takes it to long mode with the low 4 GiB identity-mapped in 2 MiB
 * pages (the 32-bit PCI hole included) and calls io_main(start_info). */

#define PTE_PRESENT 0x1
#define PTE_WRITE   0x2
#define PTE_HUGE    0x80

        .section .text.entry, "ax"
        .code32
        .globl pvh_start
pvh_start:
        cli
        movl    $stack_top, %esp
        movl    %ebx, %esi                    /* keep start_info */

        /* pml4[0] -> pdpt_low */
        movl    $pdpt_low, %eax
        orl     $(PTE_PRESENT | PTE_WRITE), %eax
        movl    %eax, pml4
        /* pdpt_low[i] -> pd_low + i * 4096, i in 0..4 */
        xorl    %ecx, %ecx
1:      movl    %ecx, %eax
        shll    $12, %eax
        addl    $pd_low, %eax
        orl     $(PTE_PRESENT | PTE_WRITE), %eax
        movl    %eax, pdpt_low(, %ecx, 8)
        incl    %ecx
        cmpl    $4, %ecx
        jne     1b
        /* pd_low[j] -> j * 2 MiB, j in 0..2048 */
        xorl    %ecx, %ecx
2:      movl    %ecx, %eax
        shll    $21, %eax
        orl     $(PTE_PRESENT | PTE_WRITE | PTE_HUGE), %eax
        movl    %eax, pd_low(, %ecx, 8)
        movl    %ecx, %eax
        shrl    $11, %eax                     /* bits 32.. of j * 2 MiB */
        movl    %eax, pd_low + 4(, %ecx, 8)
        incl    %ecx
        cmpl    $2048, %ecx
        jne     2b

        movl    $pml4, %eax
        movl    %eax, %cr3
        movl    %cr4, %eax
        orl     $0x20, %eax                   /* PAE */
        movl    %eax, %cr4
        movl    $0xc0000080, %ecx             /* EFER */
        rdmsr
        orl     $0x100, %eax                  /* LME */
        wrmsr
        movl    %cr0, %eax
        orl     $0x80000001, %eax             /* PG | PE */
        movl    %eax, %cr0
        lgdt    gdt_pointer
        ljmp    $0x08, $long_mode

        .code64
long_mode:
        movw    $0x10, %ax
        movw    %ax, %ds
        movw    %ax, %es
        movw    %ax, %ss
        movw    %ax, %fs
        movw    %ax, %gs
        movq    $stack_top, %rsp
        movl    %esi, %edi                    /* io_main(start_info) */
        call    io_main
3:      hlt
        jmp     3b

        .section .rodata
        .align  8
gdt:
        .quad   0
        .quad   0x00af9a000000ffff            /* 0x08: 64-bit code */
        .quad   0x00cf92000000ffff            /* 0x10: data */
gdt_pointer:
        .word   gdt_pointer - gdt - 1
        .long   gdt

        .section .bss
        .align  4096
        .globl  pml4, pdpt_high, pd_high
pml4:       .skip 4096
pdpt_low:   .skip 4096
pd_low:     .skip 4 * 4096
pdpt_high:  .skip 4096
pd_high:    .skip 4096
stack:      .skip 65536
stack_top:

        /* The PVH entry point, as a Xen ELF note (XEN_ELFNOTE_PHYS32_ENTRY). */
        .section .note.pvh, "a"
        .align  4
        .long   4                             /* name size */
        .long   4                             /* desc size */
        .long   18                            /* type */
        .asciz  "Xen"
        .long   pvh_start
        .section .note.GNU-stack, "", @progbits
