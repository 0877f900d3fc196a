/*
 * The fake driver's NVML (issue 35, s28): libnvidia-ml.so.1 with the calls the real pynvml makes for
 * nvsymlinkd's MIG reconstruction (nvsymlinkd/containers/hookhost.py read_nvml_mig), answering from the
 * layout the fake driver publishes (tests/vm/guest/migdriver.py), so NVML and the driver never disagree:
 *   GPUs:         <gpus>/<pci>/information ("GPU UUID:", "Device Minor:"), NVML index in PCI order;
 *   MIG devices:  <mig> (json.dumps of {"MIG-<uuid>": [GPU minor, GI, CI], ...}, the hook stand-in's table),
 *                 a GPU's MIG handles in the table's order; a GPU with one is in MIG mode.
 * <gpus> is $FAKE_NVML_GPUS or /proc/driver/nvidia/gpus, <mig> $FAKE_NVML_MIG or /run/vmtest/nvml-mig.json.
 * Signatures, return codes and constants: nvml.h (NVIDIA/go-nvml v0.13.3-0 gen/nvml/nvml.h; line numbers
 * there). Symbol names are the ones pynvml looks up (nvidia-ml-py 13.615.71: nvmlInit -> nvmlInitWithFlags,
 * nvmlDeviceGetCount -> nvmlDeviceGetCount_v2, nvmlDeviceGetHandleByIndex -> nvmlDeviceGetHandleByIndex_v2).
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;                 /* nvml.h:1295 nvmlReturn_enum */
#define NVML_SUCCESS 0                    /* nvml.h:1298 */
#define NVML_ERROR_UNINITIALIZED 1        /* nvml.h:1299 */
#define NVML_ERROR_INVALID_ARGUMENT 2     /* nvml.h:1300 */
#define NVML_ERROR_NOT_SUPPORTED 3        /* nvml.h:1301 */
#define NVML_ERROR_NOT_FOUND 6            /* nvml.h:1304 */
#define NVML_ERROR_INSUFFICIENT_SIZE 7    /* nvml.h:1305 */
#define NVML_ERROR_DRIVER_NOT_LOADED 9    /* nvml.h:1307 */
#define NVML_ERROR_UNKNOWN 999            /* nvml.h:1329 */
#define NVML_DEVICE_MIG_DISABLE 0         /* nvml.h:12483 */
#define NVML_DEVICE_MIG_ENABLE 1          /* nvml.h:12488 */
#define UUID_SIZE 96                      /* nvml.h:4080 NVML_DEVICE_UUID_V2_BUFFER_SIZE */
#define H100_MAX_MIG 7                    /* an H100's most GPU instances (1g.10gb x 7) */

struct nvmlDevice_st {                    /* nvml.h:158 typedef struct nvmlDevice_st* nvmlDevice_t */
    int mig;                              /* 0: a GPU, 1: a MIG device */
    unsigned int minor, gi, ci;           /* a MIG device's parent GPU minor */
    char uuid[UUID_SIZE];
};
typedef struct nvmlDevice_st *nvmlDevice_t;

#define MAX_GPUS 32
#define MAX_MIGS (MAX_GPUS * 8)
static struct nvmlDevice_st gpus[MAX_GPUS], migs[MAX_MIGS];
static unsigned int ngpus, nmigs, inits;

static const char *env_or(const char *name, const char *fallback)
{
    const char *v = getenv(name);
    return v && *v ? v : fallback;
}

static int by_name(const struct dirent **a, const struct dirent **b)
{
    return strcmp((*a)->d_name, (*b)->d_name);
}

/* One GPU per <gpus>/<pci>/information, PCI order (NVML numbers devices by PCI bus id). */
static int load_gpus(void)
{
    const char *dir = env_or("FAKE_NVML_GPUS", "/proc/driver/nvidia/gpus");
    struct dirent **names;
    int n = scandir(dir, &names, NULL, by_name);
    if (n < 0)
        return -1;
    ngpus = 0;
    for (int i = 0; i < n; i++) {
        char path[4096], line[256];
        FILE *f;
        struct nvmlDevice_st g = {0};
        int minor = 0;
        snprintf(path, sizeof(path), "%s/%s/information", dir, names[i]->d_name);
        free(names[i]);
        if (ngpus == MAX_GPUS || !(f = fopen(path, "r")))
            continue;
        while (fgets(line, sizeof(line), f)) {
            if (sscanf(line, "GPU UUID: %95s", g.uuid) == 1)
                continue;
            if (sscanf(line, "Device Minor: %u", &g.minor) == 1)
                minor = 1;
        }
        fclose(f);
        if (minor && g.uuid[0])
            gpus[ngpus++] = g;
    }
    free(names);
    return 0;
}

/* {"MIG-...": [gpu, gi, ci], ...} as json.dumps writes it; a missing file is no MIG device. */
static void load_migs(void)
{
    FILE *f = fopen(env_or("FAKE_NVML_MIG", "/run/vmtest/nvml-mig.json"), "r");
    char text[65536];
    size_t len;
    const char *p = text;
    nmigs = 0;
    if (!f)
        return;
    len = fread(text, 1, sizeof(text) - 1, f);
    fclose(f);
    text[len] = '\0';
    while (nmigs < MAX_MIGS && (p = strchr(p, '"'))) {
        struct nvmlDevice_st m = {.mig = 1};
        const char *end = strchr(++p, '"');
        int used = 0;
        if (!end || (size_t)(end - p) >= UUID_SIZE)
            return;
        memcpy(m.uuid, p, end - p);
        if (sscanf(end + 1, " : [ %u , %u , %u ]%n", &m.minor, &m.gi, &m.ci, &used) != 3 || !used)
            return;
        migs[nmigs++] = m;
        p = end + 1 + used;
    }
}

static int mig_enabled(unsigned int minor)
{
    for (unsigned int i = 0; i < nmigs; i++)
        if (migs[i].minor == minor)
            return 1;
    return 0;
}

static int is_gpu(nvmlDevice_t d)
{
    return d && d >= gpus && d < gpus + ngpus;
}

static int is_mig(nvmlDevice_t d)
{
    return d && d >= migs && d < migs + nmigs;
}

/* nvml.h:4019; NVML_ERROR_DRIVER_NOT_LOADED "if NVIDIA driver is not running" */
nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    if (load_gpus() < 0)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    load_migs();
    inits++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

/* nvml.h:4036 */
nvmlReturn_t nvmlShutdown(void)
{
    if (!inits)
        return NVML_ERROR_UNINITIALIZED;
    inits--;
    return NVML_SUCCESS;
}

/* pynvml's NVMLError.__str__ asks for the text of a code */
const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    default: return "Unknown Error";
    }
}

/* nvml.h:4573 */
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    if (!inits)
        return NVML_ERROR_UNINITIALIZED;
    if (!deviceCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = ngpus;
    return NVML_SUCCESS;
}

/* nvml.h:4641 */
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    if (!inits)
        return NVML_ERROR_UNINITIALIZED;
    if (index >= ngpus || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &gpus[index];
    return NVML_SUCCESS;
}

/* nvml.h:5186; NVML_ERROR_INSUFFICIENT_SIZE "if length is too small" */
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    if (!inits)
        return NVML_ERROR_UNINITIALIZED;
    if (!(is_gpu(device) || is_mig(device)) || !uuid)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(device->uuid) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(uuid, device->uuid);
    return NVML_SUCCESS;
}

/* nvml.h:5205; a MIG handle has no minor of its own */
nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    if (!inits)
        return NVML_ERROR_UNINITIALIZED;
    if (!is_gpu(device) || !minorNumber)
        return NVML_ERROR_INVALID_ARGUMENT;
    *minorNumber = device->minor;
    return NVML_SUCCESS;
}

/* nvml.h:12803; every fake GPU is an H100, MIG-capable; no pending change */
nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode)
{
    if (!inits)
        return NVML_ERROR_UNINITIALIZED;
    if (!is_gpu(device) || !currentMode || !pendingMode)
        return NVML_ERROR_INVALID_ARGUMENT;
    *currentMode = *pendingMode = mig_enabled(device->minor) ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
    return NVML_SUCCESS;
}

/* nvml.h:13414 "Returns zero if MIG is not supported or enabled" */
nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    if (!inits)
        return NVML_ERROR_UNINITIALIZED;
    if (!is_gpu(device) || !count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = mig_enabled(device->minor) ? H100_MAX_MIG : 0;
    return NVML_SUCCESS;
}

/* nvml.h:13440; NVML_ERROR_NOT_FOUND "if no valid MIG device was found at index" */
nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index, nvmlDevice_t *migDevice)
{
    unsigned int seen = 0;
    if (!inits)
        return NVML_ERROR_UNINITIALIZED;
    if (!is_gpu(device) || !migDevice)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!mig_enabled(device->minor))
        return NVML_ERROR_NOT_SUPPORTED;
    for (unsigned int i = 0; i < nmigs; i++) {
        if (migs[i].minor != device->minor)
            continue;
        if (seen++ == index) {
            *migDevice = &migs[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

/* nvml.h:13374; NVML_ERROR_INVALID_ARGUMENT for a GPU handle (not a MIG device) */
nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    if (!inits)
        return NVML_ERROR_UNINITIALIZED;
    if (!is_mig(device) || !id)
        return NVML_ERROR_INVALID_ARGUMENT;
    *id = device->gi;
    return NVML_SUCCESS;
}

/* nvml.h:13395 */
nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    if (!inits)
        return NVML_ERROR_UNINITIALIZED;
    if (!is_mig(device) || !id)
        return NVML_ERROR_INVALID_ARGUMENT;
    *id = device->ci;
    return NVML_SUCCESS;
}
