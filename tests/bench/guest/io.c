/* The I/O guest: a PVH kernel for `make bench-limits` that moves bytes as
 * fast as cloud-hypervisor lets it, so that a VMM's rate limiter can be
 * measured. Its command line picks what it does:
 *
 *   eitri.io=disk   read the first virtio-blk disk round and round, 16
 *                   requests of eitri.bs bytes (default 65536) in flight;
 *   eitri.io=net-tx send 1514-byte Ethernet frames on the first virtio-net
 *                   NIC, 64 in flight, of a type no host forwards;
 *   eitri.io=net-rx keep 64 buffers of 1514 bytes offered to receive into
 *                   on it (the host sends).
 *
 * It prints "IO-GUEST: <what> running" on COM1 once the device is set up,
 * or "IO-GUEST: <why>" if it cannot be, then polls its queue forever. The
 * host measures the rate (the VMM's counters, the tap's); the guest only
 * keeps the queue full. No interrupts: the vCPU polls the used rings. */

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long u64;

void *memset(void *d, int c, unsigned long n)
{
    u8 *p = d;
    while (n--)
        *p++ = (u8)c;
    return d;
}

void *memcpy(void *d, const void *s, unsigned long n)
{
    u8 *p = d;
    const u8 *q = s;
    while (n--)
        *p++ = *q++;
    return d;
}

static inline void outb(u16 port, u8 v) { __asm__ volatile("outb %0, %1" ::"a"(v), "Nd"(port)); }
static inline void outl(u16 port, u32 v) { __asm__ volatile("outl %0, %1" ::"a"(v), "Nd"(port)); }
static inline u32 inl(u16 port)
{
    u32 v;
    __asm__ volatile("inl %1, %0" : "=a"(v) : "Nd"(port));
    return v;
}
static inline void fence(void) { __asm__ volatile("mfence" ::: "memory"); }

static void puts(const char *s)
{
    while (*s)
        outb(0x3f8, (u8)*s++);
}

static void put_hex(u64 v)
{
    char b[19] = "0x";
    for (int i = 0; i < 16; i++)
        b[2 + i] = "0123456789abcdef"[(v >> (60 - 4 * i)) & 0xf];
    b[18] = 0;
    puts(b);
}

static void halt(const char *why)
{
    puts("IO-GUEST: ");
    puts(why);
    puts("\n");
    for (;;)
        __asm__ volatile("hlt");
}

/* ---- the command line ---- */

static const char *cmdline = "";

/* The value of `key=` on the command line, up to the next space, or 0. */
static const char *arg(const char *key, char *out, int size)
{
    for (const char *p = cmdline; *p; p++) {
        if (p != cmdline && p[-1] != ' ')
            continue;
        const char *k = key, *q = p;
        while (*k && *q == *k)
            k++, q++;
        if (*k || *q != '=')
            continue;
        int n = 0;
        for (q++; *q && *q != ' ' && n < size - 1; q++)
            out[n++] = *q;
        out[n] = 0;
        return out;
    }
    return 0;
}

static int same(const char *a, const char *b)
{
    while (*a && *a == *b)
        a++, b++;
    return *a == *b;
}

static u64 number(const char *s, u64 otherwise)
{
    if (!s || !*s)
        return otherwise;
    u64 v = 0;
    for (; *s >= '0' && *s <= '9'; s++)
        v = v * 10 + (u64)(*s - '0');
    return v;
}

/* ---- memory: the low 4 GiB are mapped by entry.S; a 64-bit BAR is
 * mapped here, its 1 GiB in 2 MiB pages, uncached ---- */

extern u64 pml4[512], pdpt_high[512], pd_high[512];

static void map_high(u64 phys)
{
    u64 gib = phys >> 30;
    if (gib < 4)
        return;
    u64 i4 = (phys >> 39) & 511, i3 = (phys >> 30) & 511;
    if (i4 == 0)
        halt("a 64-bit BAR in the first 512 GiB, above 4 GiB: not handled");
    pml4[i4] = (u64)pdpt_high | 3;
    pdpt_high[i3] = (u64)pd_high | 3;
    for (u64 j = 0; j < 512; j++)
        pd_high[j] = (gib << 30) + (j << 21) + 0x9b; /* P W PWT PCD PS */
    u64 cr3;
    __asm__ volatile("mov %%cr3, %0; mov %0, %%cr3" : "=r"(cr3)::"memory");
}

/* ---- PCI configuration space through ports 0xcf8/0xcfc ---- */

static u32 pci_read(u32 dev, u32 off)
{
    outl(0xcf8, 0x80000000u | (dev << 11) | (off & 0xfc));
    return inl(0xcfc);
}

static void pci_write(u32 dev, u32 off, u32 v)
{
    outl(0xcf8, 0x80000000u | (dev << 11) | (off & 0xfc));
    outl(0xcfc, v);
}

static u64 bar_address(u32 dev, u32 bar)
{
    u32 lo = pci_read(dev, 0x10 + 4 * bar);
    u64 addr = lo & ~0xfu;
    if (((lo >> 1) & 3) == 2)
        addr |= (u64)pci_read(dev, 0x14 + 4 * bar) << 32;
    map_high(addr);
    return addr;
}

/* ---- virtio over PCI (virtio 1.x, "modern") ---- */

struct common_cfg {
    u32 device_feature_select, device_feature;
    u32 driver_feature_select, driver_feature;
    u16 msix_config, num_queues;
    u8 device_status, config_generation;
    u16 queue_select, queue_size, queue_msix_vector, queue_enable, queue_notify_off;
    u64 queue_desc, queue_driver, queue_device;
};

struct desc {
    u64 addr;
    u32 len;
    u16 flags, next;
};

#define QSIZE 128
#define DESC_NEXT 1
#define DESC_WRITE 2

struct queue {
    struct desc desc[QSIZE] __attribute__((aligned(16)));
    struct {
        u16 flags, idx, ring[QSIZE];
    } avail __attribute__((aligned(2)));
    struct {
        u16 flags, idx;
        struct {
            u32 id, len;
        } ring[QSIZE];
    } used __attribute__((aligned(4)));
    u16 index, size, seen;
    volatile u16 *notify;
};

struct device {
    u32 pci;
    volatile struct common_cfg *common;
    volatile u8 *notify_base, *config;
    u32 notify_multiplier;
};

/* The first virtio device of `type` on bus 0, its capabilities found. */
static int find(u32 type, struct device *d)
{
    for (u32 dev = 0; dev < 32; dev++) {
        u32 id = pci_read(dev, 0);
        if ((id & 0xffff) != 0x1af4 || (id >> 16) != 0x1040 + type)
            continue;
        pci_write(dev, 4, pci_read(dev, 4) | 0x6); /* memory space, bus master */
        d->pci = dev;
        for (u32 cap = pci_read(dev, 0x34) & 0xfc; cap; cap = (pci_read(dev, cap) >> 8) & 0xfc) {
            u32 head = pci_read(dev, cap);
            if ((head & 0xff) != 0x09)
                continue;
            u32 cfg_type = head >> 24;
            u64 at = bar_address(dev, pci_read(dev, cap + 4) & 0xff) + pci_read(dev, cap + 8);
            if (cfg_type == 1)
                d->common = (volatile struct common_cfg *)at;
            else if (cfg_type == 2) {
                d->notify_base = (volatile u8 *)at;
                d->notify_multiplier = pci_read(dev, cap + 16);
            } else if (cfg_type == 4)
                d->config = (volatile u8 *)at;
        }
        if (!d->common || !d->notify_base)
            halt("a virtio device without its common or notify capability");
        return 1;
    }
    return 0;
}

/* Reset, acknowledge, and agree on VIRTIO_F_VERSION_1 alone. */
static void negotiate(struct device *d)
{
    volatile struct common_cfg *c = d->common;
    c->device_status = 0;
    while (c->device_status)
        ;
    c->device_status = 1 | 2; /* ACKNOWLEDGE | DRIVER */
    c->device_feature_select = 1;
    if (!(c->device_feature & 1))
        halt("the device does not offer VIRTIO_F_VERSION_1");
    c->driver_feature_select = 0;
    c->driver_feature = 0;
    c->driver_feature_select = 1;
    c->driver_feature = 1;
    c->device_status = 1 | 2 | 8; /* FEATURES_OK */
    if (!(c->device_status & 8))
        halt("the device refused the features");
    c->msix_config = 0xffff;
}

static void setup(struct device *d, struct queue *q, u16 index)
{
    volatile struct common_cfg *c = d->common;
    c->queue_select = index;
    u16 size = c->queue_size;
    if (size > QSIZE)
        size = QSIZE;
    c->queue_size = size;
    c->queue_msix_vector = 0xffff;
    c->queue_desc = (u64)q->desc;
    c->queue_driver = (u64)&q->avail;
    c->queue_device = (u64)&q->used;
    q->notify = (volatile u16 *)(d->notify_base + (u64)c->queue_notify_off * d->notify_multiplier);
    q->index = index;
    q->size = size;
    c->queue_enable = 1;
}

static void start(struct device *d) { d->common->device_status = 1 | 2 | 8 | 4; /* DRIVER_OK */ }

/* Offers the chain that starts at descriptor `head`. */
static void offer(struct queue *q, u16 head)
{
    q->avail.ring[q->avail.idx % q->size] = head;
    fence();
    q->avail.idx++;
    fence();
}

static void kick(struct queue *q) { *q->notify = q->index; }

/* The head of the next chain the device has used, or -1. */
static int used(struct queue *q)
{
    fence();
    if (*(volatile u16 *)&q->used.idx == q->seen)
        return -1;
    u16 head = (u16)q->used.ring[q->seen % q->size].id;
    q->seen++;
    return head;
}

/* ---- the disk: reads of `bs` bytes, 16 in flight ---- */

#define DEPTH 16

struct blk_request {
    u32 type, reserved;
    u64 sector;
};

static struct queue blk_queue __attribute__((aligned(4096)));
static struct blk_request requests[DEPTH];
static u8 statuses[DEPTH];
static u8 buffers[DEPTH][65536] __attribute__((aligned(4096)));
static u64 sectors, step, next_sector;

/* Offers request `i` (descriptors 3i..3i+2) for the next `step` sectors. */
static void read_next(struct queue *q, u16 i)
{
    requests[i] = (struct blk_request){0, 0, next_sector}; /* VIRTIO_BLK_T_IN */
    statuses[i] = 0xff;
    next_sector += step;
    if (next_sector + step > sectors)
        next_sector = 0;
    offer(q, (u16)(3 * i));
}

static void disk(u64 bs)
{
    struct device d = {0};
    if (!find(2, &d))
        halt("no virtio-blk device");
    if (bs < 512 || bs > sizeof buffers[0] || bs % 512)
        halt("eitri.bs must be a multiple of 512, at most 65536");
    negotiate(&d);
    sectors = *(volatile u64 *)d.config;
    step = bs / 512;
    if (sectors < step * DEPTH)
        halt("a disk too small to read");
    struct queue *q = &blk_queue;
    setup(&d, q, 0);
    start(&d);
    for (u16 i = 0; i < DEPTH; i++) {
        struct desc *t = &q->desc[3 * i];
        t[0] = (struct desc){(u64)&requests[i], sizeof requests[i], DESC_NEXT, (u16)(3 * i + 1)};
        t[1] = (struct desc){(u64)buffers[i], (u32)bs, DESC_NEXT | DESC_WRITE, (u16)(3 * i + 2)};
        t[2] = (struct desc){(u64)&statuses[i], 1, DESC_WRITE, 0};
    }
    puts("IO-GUEST: disk running, ");
    put_hex(sectors);
    puts(" sectors\n");
    for (u16 i = 0; i < DEPTH; i++)
        read_next(q, i);
    kick(q);
    for (;;) {
        int head;
        while ((head = used(q)) < 0)
            ;
        if (statuses[head / 3] != 0)
            halt("a read failed");
        read_next(q, (u16)(head / 3));
        kick(q);
    }
}

/* ---- the NIC: 1514-byte frames sent, 64 in flight, or 64 buffers of as
 * many offered to receive into ---- */

#define FRAMES 64
#define FRAME 1514
#define NET_HEADER 12 /* struct virtio_net_hdr, with VERSION_1 */

static struct queue rx_queue __attribute__((aligned(4096)));
static struct queue tx_queue __attribute__((aligned(4096)));
static u8 frames[FRAMES][NET_HEADER + FRAME] __attribute__((aligned(64)));

/* Keeps every chain of `q` offered: each one used is offered again. */
static void recycle(struct queue *q)
{
    for (u16 i = 0; i < FRAMES; i++)
        offer(q, i);
    kick(q);
    for (;;) {
        int head;
        while ((head = used(q)) < 0)
            ;
        offer(q, (u16)head);
        kick(q);
    }
}

static void net(int send)
{
    struct device d = {0};
    if (!find(1, &d))
        halt("no virtio-net device");
    negotiate(&d);
    setup(&d, &rx_queue, 0);
    setup(&d, &tx_queue, 1);
    start(&d);
    struct queue *q = send ? &tx_queue : &rx_queue;
    for (u16 i = 0; i < FRAMES; i++) {
        u8 *f = frames[i] + NET_HEADER; /* the header stays all zero */
        memset(f, 0xff, 6);             /* to everyone... */
        f[6] = 0x02;                    /* ...from a local address... */
        f[11] = (u8)i;
        f[12] = 0x88; /* ...of EtherType 0x88b5, local experimental */
        f[13] = 0xb5;
        q->desc[i] = (struct desc){(u64)frames[i], NET_HEADER + FRAME, send ? 0 : DESC_WRITE, 0};
    }
    puts(send ? "IO-GUEST: net-tx running\n" : "IO-GUEST: net-rx running\n");
    recycle(q);
}

void io_main(u32 start_info)
{
    volatile u32 *info = (volatile u32 *)(u64)start_info;
    if (info[0] == 0x336ec578 && info[6])
        cmdline = (const char *)(u64)info[6];
    char what[16], bs[16];
    puts("IO-GUEST: up\n");
    if (!arg("eitri.io", what, sizeof what))
        halt("no eitri.io= on the command line");
    if (same(what, "disk"))
        disk(number(arg("eitri.bs", bs, sizeof bs), 65536));
    if (same(what, "net-tx"))
        net(1);
    if (same(what, "net-rx"))
        net(0);
    halt("eitri.io is disk, net-tx or net-rx");
}
