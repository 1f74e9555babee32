#!/usr/bin/env bash
# Superseded: the speedrun now runs under the record protocol (fixed-step recipes, >= 5 seeds, a t-test);
# its device script is dev/speedrun/device_record.sh (search on choosing seeds, judging, cold process, record.json,
# confirmation on fresh seeds, lab eval, gpu tests).
echo "dev/device/device_speedrun.sh is superseded: run dev/speedrun/device_record.sh (STAGES=\"search cold record confirm eval tests\")"
exec bash "$(dirname "$0")/../speedrun/device_record.sh" "$@"
