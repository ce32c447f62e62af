# What `cmake --install build --prefix P` puts in P:
#   include/scaletrain/...      the public headers (every header of the two
#                               libraries except the internal ones below)
#   lib/libscaletrain_core.so   torch-free: tokenizers, token files, sampler,
#                               launcher contract, estimator, safetensors,
#                               the config readers
#   lib/libscaletrain.so        the engines, models, checkpoints, trainer
#   lib/cmake/scaletrain/       the CMake package: find_package(scaletrain)
#   bin/scaletrain              the CLI (launch, train, checkpoint, ...)
#
# Components of the package: `core` (scaletrain::core, no libtorch needed) and
# `scaletrain` (scaletrain::scaletrain, the default; it brings core along).
include(CMakePackageConfigHelpers)

# Headers that only our own sources include: they name private dependencies
# (yaml-cpp) or wire formats. tests/examples/cpp_package.sh verifies that no
# installed header includes one of them.
set(SCALETRAIN_INTERNAL_HEADERS
  comm/rendezvous_protocol.h   # the store's wire format
  comm/rendezvous_server.h     # the store's server (world.cpp runs it)
  checkpoint/safetensors_detail.h
  parallel/fsdp/engine_state.h  # the sharded engine's state
  config/accelerate_config.h   # yaml-cpp
  config/config_values.h       # yaml-cpp
  data/utf8.h)
file(GLOB_RECURSE _st_headers RELATIVE ${PROJECT_SOURCE_DIR}/src/scaletrain CONFIGURE_DEPENDS
     ${PROJECT_SOURCE_DIR}/src/scaletrain/*.h)
list(REMOVE_ITEM _st_headers ${SCALETRAIN_INTERNAL_HEADERS})
list(FILTER _st_headers EXCLUDE REGEX "_internal\\.h$")  # the pieces of one split file share these
if(NOT SCALETRAIN_RPC)
  list(FILTER _st_headers EXCLUDE REGEX "^rpc/")
endif()
foreach(_h IN LISTS _st_headers)
  get_filename_component(_dir ${_h} DIRECTORY)
  install(FILES src/scaletrain/${_h} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/scaletrain/${_dir})
endforeach()

install(TARGETS scaletrain_core EXPORT scaletrainCoreTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS scaletrain_lib EXPORT scaletrainTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS scaletrain RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

set(_st_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/scaletrain)
install(EXPORT scaletrainCoreTargets NAMESPACE scaletrain:: DESTINATION ${_st_cmake_dir})
install(EXPORT scaletrainTargets NAMESPACE scaletrain:: DESTINATION ${_st_cmake_dir})
# The package finds the same libtorch it was built against (Torch_DIR and its
# version are written into the config), so USE_DISTRIBUTED and the c10d
# struct layouts agree between the library and its users.
set(SCALETRAIN_TORCH_DIR ${Torch_DIR})
set(SCALETRAIN_TORCH_VERSION ${Torch_VERSION})
# comm/group.h includes c10d's Gloo process group, whose own headers come
# from Gloo (Debian: libgloo-dev), not from libtorch: the package looks for
# them where this build found them, and says so when they are missing.
find_path(SCALETRAIN_GLOO_INCLUDE_DIR gloo/config.h)
configure_package_config_file(cmake/scaletrainConfig.cmake.in
                              ${CMAKE_CURRENT_BINARY_DIR}/scaletrainConfig.cmake
                              INSTALL_DESTINATION ${_st_cmake_dir})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/scaletrainConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/scaletrainConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/scaletrainConfigVersion.cmake
        DESTINATION ${_st_cmake_dir})
