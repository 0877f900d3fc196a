# What zsh offers for a command line: zsh -f tests/zcomplete.zsh COMPLETIONS_DIR 'LINE' prints each
# candidate compadd receives, one per line, from a real interactive zsh (zpty) pressing TAB after
# LINE with `compinit` and the completion file in $fpath (tests/test_completions.py).
zmodload zsh/zpty || exit 3
zpty z zsh -f -i
zpty -w z "PROMPT=''; RPROMPT=''; fpath=($1 \$fpath); autoload -Uz compinit; compinit -u -D"
zpty -w z 'compadd () { local -a __hits; builtin compadd -A __hits "$@"; local h; for h in $__hits; do print -r -- "<<$h>>"; done; builtin compadd "$@"; }'
zpty -w z "zstyle ':completion:*' list-prompt ''; zstyle ':completion:*' menu no"
zpty -w z 'print -r -- READY'
zpty -r z line '*READY*' || exit 4
zpty -n -w z "$2"$'\t'
out=""
quiet=0
for i in {1..40}; do  # up to 10 s; done once candidates came and nothing more for 1 s
    sleep 0.25
    got=0
    while zpty -r -t z chunk; do out+=$chunk; got=1; done
    (( got )) && quiet=0 || (( quiet++ ))
    [[ $out == *'<<'* ]] && (( quiet >= 4 )) && break
done
print -r -- "$out" | grep -ao '<<[^>]*>>' | sed 's/^<<//; s/>>$//' | sort -u
zpty -d z
