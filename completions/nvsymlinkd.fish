# fish completion for nvsymlinkd(8): packages install it as
# /usr/share/fish/vendor_completions.d/nvsymlinkd.fish. tests/test_manpages.py checks that every
# command and option is here; tests/test_completions.py runs `complete -C` in fish.

set -l commands sync run check repair render

function __nvsymlinkd_containers --description 'GPU containers: short ids and names'
    command -q nvsymlinkd; or return
    set -l tokens (commandline -opc)
    set -l root
    for i in (seq (count $tokens))
        if test "$tokens[$i]" = --root; and test $i -lt (count $tokens)
            set root --root $tokens[(math $i + 1)]
        end
    end
    # names are data: only id/name characters are offered (fish inserts them escaped)
    nvsymlinkd $root complete-containers 2>/dev/null | string match -r '^[A-Za-z0-9][A-Za-z0-9_.+/-]*$'
end

complete -c nvsymlinkd -f
complete -c nvsymlinkd -l root -r -a '(__fish_complete_directories)' -d 'resolve every host path under DIR'
complete -c nvsymlinkd -l config -r -F -d 'config file'
complete -c nvsymlinkd -n "not __fish_seen_subcommand_from $commands" -l version -d 'print the version'
complete -c nvsymlinkd -l help -d 'show help'

complete -c nvsymlinkd -n "not __fish_seen_subcommand_from $commands" -a sync -d 'make /dev/char links exact, once'
complete -c nvsymlinkd -n "not __fish_seen_subcommand_from $commands" -a run -d 'the event daemon'
complete -c nvsymlinkd -n "not __fish_seen_subcommand_from $commands" -a check -d 'verify GPU containers and the host'
complete -c nvsymlinkd -n "not __fish_seen_subcommand_from $commands" -a repair -d 're-grant lost NVIDIA devices'
complete -c nvsymlinkd -n "not __fish_seen_subcommand_from $commands" -a render -d 'write the udev rule and units'

# link options: sync, run, render
complete -c nvsymlinkd -n '__fish_seen_subcommand_from sync run render' -l driver-root -r -a '(__fish_complete_directories)' -d "where the driver's dev/ lives"
complete -c nvsymlinkd -n '__fish_seen_subcommand_from sync run render' -l dev-char-path -r -a '(__fish_complete_directories)' -d 'symlink directory'
complete -c nvsymlinkd -n '__fish_seen_subcommand_from sync run render' -l create-nodes -d 'also create missing device nodes'

complete -c nvsymlinkd -n '__fish_seen_subcommand_from sync' -l dry-run -d 'print the plan; change nothing'
complete -c nvsymlinkd -n '__fish_seen_subcommand_from sync' -l json -d 'print a JSON document'
complete -c nvsymlinkd -n '__fish_seen_subcommand_from sync' -l create-all -d 'nvidia-ctk: accepted, links every node that exists'
complete -c nvsymlinkd -n '__fish_seen_subcommand_from sync' -l create-device-nodes -d 'nvidia-ctk name for --create-nodes'
complete -c nvsymlinkd -n '__fish_seen_subcommand_from sync' -l load-kernel-modules -d 'ignored alone; refused with --create-all'
complete -c nvsymlinkd -n '__fish_seen_subcommand_from sync' -l watch -d 'refused: use nvsymlinkd run'

complete -c nvsymlinkd -n '__fish_seen_subcommand_from run render' -l resync-interval -x -d 'full resync period, seconds'

complete -c nvsymlinkd -n '__fish_seen_subcommand_from check' -l json -d 'print a JSON document'
complete -c nvsymlinkd -n '__fish_seen_subcommand_from check' -l no-bus -d 'do not ask systemd over D-Bus'
complete -c nvsymlinkd -n '__fish_seen_subcommand_from check' -l no-host -d 'containers only'
complete -c nvsymlinkd -n '__fish_seen_subcommand_from check' -l wide -d 'full lines at a terminal too'

complete -c nvsymlinkd -n '__fish_seen_subcommand_from repair' -l dry-run -d 'print what would be granted'
complete -c nvsymlinkd -n '__fish_seen_subcommand_from repair' -l force -d 'repair within the rate limit window'
complete -c nvsymlinkd -n '__fish_seen_subcommand_from repair' -l before-reload -d 'for package scripts: prevent every at-risk container before a daemon-reload'
complete -c nvsymlinkd -n '__fish_seen_subcommand_from repair' -l json -d 'print a JSON document'

complete -c nvsymlinkd -n '__fish_seen_subcommand_from check repair' -a '(__nvsymlinkd_containers)' -d 'GPU container'

complete -c nvsymlinkd -n '__fish_seen_subcommand_from render' -l output -r -a '(__fish_complete_directories)' -d 'write the rule and units to DIR'
complete -c nvsymlinkd -n '__fish_seen_subcommand_from render' -l drop-ins -r -a '(__fish_complete_directories)' -d 'write drop-ins to DIR'
complete -c nvsymlinkd -n '__fish_seen_subcommand_from render' -l bindir -r -a '(__fish_complete_directories)' -d 'where nvsymlinkd is installed'
complete -c nvsymlinkd -n '__fish_seen_subcommand_from render' -l watchdog-sec -x -d 'WatchdogSec='
complete -c nvsymlinkd -n '__fish_seen_subcommand_from render' -l state-dir -r -a '(__fish_complete_directories)' -d 'state directory'
