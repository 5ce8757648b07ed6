#pragma once
#define HH_TARGET_PREFERRED 0
