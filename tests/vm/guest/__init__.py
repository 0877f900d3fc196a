"""Guest-side helpers of the VM scenarios (vmguest, stacks, pkgsteps, kubepod, chaos, chaosrun) and the
programs runc runs there (nvidia_hook, nvidia_runtime). They import one another as
`tests.vm.guest.<module>`: the guest's runner puts /mnt/src (the checkout) on PYTHONPATH.
"""
