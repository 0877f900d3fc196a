// SPDX-License-Identifier: GPL-2.0
/*
 * Fake NVIDIA frontend for the VM tests: char major 195 named "nvidia-frontend" (as in
 * /proc/devices up to the 535 branch), open() always succeeds. Like the real driver it
 * creates no sysfs class device, so udev makes no /dev/char/195:N link and there is no
 * /sys/dev/char/195:N: the device nodes come from mknod, exactly the failure-1 setup.
 * Inside a container, open() returning 0 means the device cgroup allowed it; EPERM means
 * it did not. The kernel is the judge.
 */
#include <linux/fs.h>
#include <linux/module.h>

#define NV_MAJOR 195

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

	return ret < 0 ? ret : 0;
}

static void __exit nv_exit(void)
{
	unregister_chrdev(NV_MAJOR, "nvidia-frontend");
}

module_init(nv_init);
module_exit(nv_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("fake NVIDIA frontend (nvsymlinkd VM tests)");
