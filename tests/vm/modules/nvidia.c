// SPDX-License-Identifier: GPL-2.0
/*
 * Fake NVIDIA frontend for the VM tests: char major 195 named "nvidia-frontend" (as in
 * /proc/devices up to the 535 branch), open() always succeeds. Like the real driver it
 * creates no sysfs class device, so udev makes no /dev/char/195:N link and there is no
 * /sys/dev/char/195:N: the device nodes come from mknod, exactly the failure-1 setup.
 * Inside a container, open() returning 0 means the device cgroup allowed it; EPERM means
 * it did not. The kernel is the judge.
 * caps=1 also registers a dynamic major named "nvidia-caps", as the real nvidia.ko does for the
 * MIG capability nodes /dev/nvidia-caps/nvidia-capN (open-gpu-kernel-modules 595.45.04
 * kernel-open/nvidia/nv-caps.c:811-826 nv_cap_drv_init: alloc_chrdev_region(..., "nvidia-caps"),
 * called from nv.c:714 at module load); off by default, so every other scenario's /proc/devices
 * stays as it was.
 */
#include <linux/fs.h>
#include <linux/module.h>

#define NV_MAJOR 195

static bool caps;
module_param(caps, bool, 0444);
MODULE_PARM_DESC(caps, "also register a dynamic \"nvidia-caps\" major (MIG capabilities)");
static int caps_major;

static int nv_open(struct inode *inode, struct file *file) { return 0; }
static int nv_release(struct inode *inode, struct file *file) { return 0; }

static const struct file_operations nv_fops = {
	.owner = THIS_MODULE,
	.open = nv_open,
	.release = nv_release,
};

static int __init nv_init(void)
{
	int ret = register_chrdev(NV_MAJOR, "nvidia-frontend", &nv_fops);

	if (ret < 0 || !caps)
		return ret < 0 ? ret : 0;
	ret = register_chrdev(0, "nvidia-caps", &nv_fops);
	if (ret < 0) {
		unregister_chrdev(NV_MAJOR, "nvidia-frontend");
		return ret;
	}
	caps_major = ret;
	return 0;
}

static void __exit nv_exit(void)
{
	if (caps_major)
		unregister_chrdev(caps_major, "nvidia-caps");
	unregister_chrdev(NV_MAJOR, "nvidia-frontend");
}

module_init(nv_init);
module_exit(nv_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("fake NVIDIA frontend (nvsymlinkd VM tests)");
