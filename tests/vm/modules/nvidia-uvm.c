// SPDX-License-Identifier: GPL-2.0
/*
 * Fake nvidia-uvm for the VM tests: a dynamic char major named "nvidia-uvm", open() always
 * succeeds, no sysfs class device (no /dev/char link on its own). The module is named
 * nvidia_uvm in uevents (KERNEL=="nvidia_uvm"), like the real nvidia-uvm.ko.
 * major=N asks for that major (the chaos soak's "reloaded on another major"); 0: dynamic.
 */
#include <linux/fs.h>
#include <linux/module.h>

static int uvm_major;
static int major;
module_param(major, int, 0444);
MODULE_PARM_DESC(major, "char major to register (0: dynamic)");

static int uvm_open(struct inode *inode, struct file *file) { return 0; }
static int uvm_release(struct inode *inode, struct file *file) { return 0; }

static const struct file_operations uvm_fops = {
	.owner = THIS_MODULE,
	.open = uvm_open,
	.release = uvm_release,
};

static int __init uvm_init(void)
{
	int ret = register_chrdev(major, "nvidia-uvm", &uvm_fops);

	if (ret < 0)
		return ret;
	uvm_major = major ? major : ret;
	return 0;
}

static void __exit uvm_exit(void)
{
	unregister_chrdev(uvm_major, "nvidia-uvm");
}

module_init(uvm_init);
module_exit(uvm_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("fake nvidia-uvm (nvsymlinkd VM tests)");
