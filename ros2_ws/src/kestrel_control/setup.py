from glob import glob

from setuptools import find_packages, setup

package_name = 'kestrel_control'

setup(
    name=package_name,
    version='0.1.0',
    packages=find_packages(exclude=['test']),
    data_files=[
        ('share/ament_index/resource_index/packages', ['resource/' + package_name]),
        ('share/' + package_name, ['package.xml']),
        ('share/' + package_name + '/launch', glob('launch/*.launch.py')),
        ('share/' + package_name + '/config', glob('config/*.yaml')),
        # the trained reaching policy (rsl_rl exports + metrics.json with its node parameters)
        ('share/' + package_name + '/weights/reach', glob('weights/reach/*')),
    ],
    package_data={package_name: ['worlds/*.xml', 'core/*.c']},
    include_package_data=True,
    install_requires=['setuptools'],
    zip_safe=True,
    maintainer='Kestrel developers',
    maintainer_email='dev@kestrel.invalid',
    description='Kestrel real-time learned-policy control node.',
    license='Apache-2.0',
    entry_points={
        'console_scripts': [
            'control_node = kestrel_control.control_node:main',
        ],
    },
)
